"""Which embedding modules of a user's ``nn.Module`` are fedsub's row tables, checked.

A table is an ``nn.Embedding`` or ``nn.EmbeddingBag`` whose rows are the dataset table's rows:
clients pull the rows of S(k), push row deltas, and FedSubAvg scales each row by its heat.
They are given as ``tables={table: module or attribute path}``, or found by name: a module
whose attribute path, or the last part of it, is the table's name. Every other parameter is
dense (every client trains all of it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

from fedsub.data.federated import FederatedDataset
from fedsub.errors import ConfigError

TableModule = nn.Embedding | nn.EmbeddingBag
TableSpec = Mapping[str, nn.Module | str]


def table_paths(
    module: nn.Module, dataset: FederatedDataset, tables: TableSpec | None = None
) -> dict[str, str]:
    """Per dataset table, the attribute path of its embedding module in ``module``, each
    checked against the dataset (``check_table_module``)."""
    paths = _named(module, dataset, tables) if tables is not None else _by_name(module, dataset)
    for table, path in paths.items():
        check_table_module(path, module.get_submodule(path), table, dataset.table_rows[table])
    _check_not_shared(module, paths)
    return paths


def table_module(module: nn.Module, path: str) -> TableModule:
    """The table module at ``path`` (checked by ``table_paths``)."""
    found = module.get_submodule(path)
    if not isinstance(found, TableModule):
        raise ConfigError(f"module {path!r} is a {type(found).__name__}, not an embedding")
    return found


def embedding_modules(module: nn.Module) -> dict[str, TableModule]:
    """The module's embedding modules by attribute path (the module itself is path "")."""
    return {p: m for p, m in module.named_modules() if isinstance(m, TableModule)}


def _named(module: nn.Module, dataset: FederatedDataset, tables: TableSpec) -> dict[str, str]:
    unknown = sorted(set(tables) - set(dataset.table_rows))
    if unknown:
        raise ConfigError(
            f"tables names {unknown[0]!r}, which is not a table of dataset {dataset.name}; "
            f"its tables are {_listed(dataset.table_rows)}"
        )
    paths = {t: _path_of(module, t, given) for t, given in tables.items()}
    missing = sorted(set(dataset.table_rows) - set(paths))
    if missing:
        raise ConfigError(
            f"dataset {dataset.name}'s table {missing[0]!r} (read by fields "
            f"{_listed(dataset.fields_of(missing[0]))}) has no module in tables; every table "
            f"needs its embedding module (found: {_listed(embedding_modules(module))})"
        )
    twice = [t for t in paths if list(paths.values()).count(paths[t]) > 1]
    if twice:
        raise ConfigError(
            f"tables gives module {paths[twice[0]]!r} for tables {_listed(twice)}; one module "
            "holds one table (several fields may read it: the dataset's field_tables)"
        )
    return {t: paths[t] for t in dataset.table_rows}


def _path_of(module: nn.Module, table: str, given: nn.Module | str) -> str:
    if isinstance(given, str):
        try:
            module.get_submodule(given)
        except AttributeError:
            raise ConfigError(
                f"tables[{table!r}] = {given!r}: the module has no submodule at that path; "
                f"its embedding modules are {_listed(embedding_modules(module))}"
            ) from None
        return given
    for path, candidate in module.named_modules():
        if candidate is given:
            return path
    raise ConfigError(
        f"tables[{table!r}] is a {type(given).__name__} that is not a submodule of the model "
        f"(its embedding modules are {_listed(embedding_modules(module))})"
    )


def _by_name(module: nn.Module, dataset: FederatedDataset) -> dict[str, str]:
    """Each table's module found by name; every embedding module must be a table."""
    found = embedding_modules(module)
    hint = "pass tables={table: module or attribute path} to say which module holds which table"
    paths = {}
    for table in dataset.table_rows:
        exact = [p for p in found if p == table]
        named = exact or [p for p in found if p.rsplit(".", 1)[-1] == table]
        if not named:
            raise ConfigError(
                f"no embedding module is named after dataset {dataset.name}'s table {table!r} "
                f"(its embedding modules: {_listed(found)}); {hint}"
            )
        if len(named) > 1:
            raise ConfigError(
                f"table {table!r} matches several embedding modules ({_listed(named)}); {hint}"
            )
        paths[table] = named[0]
    extra = sorted(set(found) - set(paths.values()))
    if extra:
        raise ConfigError(
            f"embedding module(s) {_listed(extra)} match no table of dataset {dataset.name} "
            f"({_listed(dataset.table_rows)}); {hint} (modules left out are trained as dense "
            "parameters)"
        )
    return paths


def check_table_module(path: str, module: nn.Module, table: str, rows: int) -> None:
    """A table module holds exactly the dataset table's rows in a plain, trainable ``weight``
    and none of the options that assume global row ids or dense gradients."""
    where = f"module {path!r} (table {table!r})"
    if not isinstance(module, TableModule):
        raise ConfigError(
            f"{where} is a {type(module).__name__}; a table is an nn.Embedding or nn.EmbeddingBag"
        )
    if module.num_embeddings != rows:
        raise ConfigError(
            f"{where} has {module.num_embeddings} rows of dimension {module.embedding_dim}; "
            f"the dataset's table has {rows}: build it with num_embeddings={rows} "
            "(the dataset's table_rows)"
        )
    refused = {
        "padding_idx": (
            module.padding_idx is not None,
            "clients see their rows renumbered (positions in S(k)), so a padding row id "
            "means another row there; fedsub's ids are ragged and need no padding",
        ),
        "max_norm": (
            module.max_norm is not None,
            "it rescales rows in place during the forward pass",
        ),
        "sparse": (
            module.sparse,
            "fedsub already moves only the rows a client touches; build it with sparse=False",
        ),
    }
    for option, (is_set, why) in refused.items():
        if is_set:
            raise ConfigError(f"{where} sets {option}, which fedsub cannot train: {why}")
    if not module.weight.requires_grad:
        raise ConfigError(f"{where}: its weight is frozen (requires_grad=False); a table trains")


def _check_not_shared(module: nn.Module, paths: dict[str, str]) -> None:
    """No table weight is also used elsewhere under another name (weight tying): a client
    would then need every row as a dense parameter."""
    owners = {id(module.get_submodule(p).weight): p for p in paths.values()}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        owner = owners.get(id(parameter))
        if owner is not None and name != (f"{owner}.weight" if owner else "weight"):
            raise ConfigError(
                f"parameter {name!r} is the weight of table module {owner!r} (tied weights); "
                "a table's rows cannot also be a dense parameter"
            )


def _listed(names: Iterable[str]) -> str:
    items = list(names)
    return ", ".join(repr(n) for n in items) if items else "none"
