"""``python -m fedsub`` and the ``fedsub`` command: the command line, also as torchrun starts
it (``torchrun --nproc-per-node N -m fedsub run CONFIG``).

The command line's imports (torch among them) take a second or two; Ctrl-C during them exits
130 quietly, as it does later, instead of printing the import's traceback."""

import sys


def main() -> int:
    try:
        from fedsub.cli import main as cli_main
    except KeyboardInterrupt:
        print("fedsub: interrupted", file=sys.stderr)
        return 130
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
