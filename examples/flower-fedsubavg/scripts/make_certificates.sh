#!/usr/bin/env bash
# Makes what a TLS + SuperNode-authenticated Flower deployment of this example needs:
#   ca.crt / ca.key             a self-signed certificate authority (EC P-384 keys throughout) (the nodes' root certificate)
#   server.crt / server.key     the SuperLink's TLS certificate, signed by that CA, valid for
#                               localhost, 127.0.0.1 and the host names given in SERVER_NAMES
#   supernode-<i> / .pub        one ECDSA P-384 key pair per SuperNode (OpenSSH format, as
#                               `flower-supernode --auth-supernode-private-key` and
#                               `flwr supernode register` read them)
#
# Usage: make_certificates.sh OUT_DIR [NODES]     (NODES defaults to 3)
#
# OUT_DIR must lie outside the app folder: `flwr run .` ships the app folder to every node,
# private keys included.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 OUT_DIR [NODES]" >&2
    exit 2
fi
out_dir=$1
nodes=${2:-3}
if ! [[ $nodes =~ ^[1-9][0-9]*$ ]]; then
    echo "$0: error: NODES = '$nodes'; expected a positive whole number" >&2
    exit 2
fi
app_dir=$(cd "$(dirname "$0")/.." && pwd -P)

# OUT_DIR as an absolute path with its existing part resolved, computed without creating
# anything: a refusal below must leave nothing behind.
existing=$out_dir
rest=""
while [[ ! -e $existing ]]; do
    rest="/$(basename "$existing")$rest"
    existing=$(dirname "$existing")
done
if [[ ! -d $existing ]]; then
    echo "$0: error: OUT_DIR '$out_dir': $existing is not a folder" >&2
    exit 2
fi
base=$(cd "$existing" && pwd -P)
out_dir="${base%/}$rest"
if [[ $out_dir == "$app_dir" || $out_dir == "$app_dir"/* ]]; then
    echo "$0: error: OUT_DIR '$out_dir' is inside the app folder $app_dir;" \
        "flwr run would ship the private keys to every node: choose a folder outside it" >&2
    exit 2
fi
for name in ca.crt ca.key server.crt server.key supernode-1; do
    if [[ -e $out_dir/$name ]]; then
        echo "$0: error: $out_dir/$name exists; remove it or choose another OUT_DIR" >&2
        exit 2
    fi
done
made=""  # the folders this script creates, removed again if it fails
if [[ ! -d $out_dir ]]; then
    made=${base%/}
    mkdir -p "$out_dir"
fi

# Everything is written to a scratch folder first, so a failure leaves nothing half-made
# (and the folders made above are removed again when nothing went into them).
scratch=$(mktemp -d "$out_dir/.making.XXXXXX")
cleanup() {
    rm -rf "$scratch"
    if [[ -n $made && -z "$(ls -A "$out_dir")" ]]; then
        dir=$out_dir
        while [[ $dir != "$made" && $dir == "$made"/* ]] && rmdir "$dir" 2>/dev/null; do
            dir=$(dirname "$dir")
        done
    fi
}
trap cleanup EXIT

alt_names="DNS:localhost,IP:127.0.0.1,IP:::1"
for name in ${SERVER_NAMES:-}; do
    if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then alt_names+=",IP:$name"; else alt_names+=",DNS:$name"; fi
done

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-384 -sha256 -days 365 -nodes -subj "/CN=fedsub Flower CA" \
    -keyout "$scratch/ca.key" -out "$scratch/ca.crt" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-384 -sha256 -nodes -subj "/CN=localhost" \
    -keyout "$scratch/server.key" -out "$scratch/server.csr" 2>/dev/null
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n' \
    "$alt_names" >"$scratch/server.ext"
openssl x509 -req -sha256 -days 365 -in "$scratch/server.csr" -CA "$scratch/ca.crt" \
    -CAkey "$scratch/ca.key" -CAcreateserial -extfile "$scratch/server.ext" \
    -out "$scratch/server.crt" 2>/dev/null
rm -f "$scratch/server.csr" "$scratch/server.ext" "$scratch/ca.srl"

for ((i = 1; i <= nodes; i++)); do
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "fedsub-supernode-$i" -f "$scratch/supernode-$i"
done

chmod 600 "$scratch"/*.key "$scratch"/supernode-*[0-9]
mv "$scratch"/* "$out_dir"/
echo "wrote the CA, the SuperLink's certificate and $nodes SuperNode key pairs to $out_dir"
