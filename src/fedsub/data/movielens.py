"""``movielens-100k`` and ``movielens-1m``: the GroupLens archives as distributed.

Seed 001, section 5.1: label = rating >= 4; one-hot gender, age group, movie, gender x movie
and age x movie in one feature table; clients = users; a seeded random 80/20 split of all
samples (users left without training samples are dropped). ML-100K's ages are bucketed into
ML-1M's groups (1: under 18, 18: 18-24, 25: 25-34, 35: 35-44, 45: 45-49, 50: 50-55, 56: 56+).

Files: ML-100K ``u.data`` (tab: user, item, rating, timestamp), ``u.user`` (pipe: user, age,
gender, occupation, zip), ``u.item`` (Latin-1, pipe; movie id first); ML-1M ``ratings.dat``
and ``users.dat`` (``::`` separated, coded ages), ``movies.dat`` (Latin-1). ``data.path`` is
the extracted folder or the zip; without it the archive fetched into the cache is used.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedsub.data.federated import FederatedDataset, SampleSet
from fedsub.data.fetch import cached_file
from fedsub.data.ragged import Ragged
from fedsub.errors import DataError

AGE_GROUPS = (1, 18, 25, 35, 45, 50, 56)
TABLE = "features"


@dataclass(frozen=True)
class MovieLensOptions:
    test_fraction: float = field(default=0.2, metadata={"min": 0.0, "max": 0.9})
    """Each user's share of ratings held out into the pooled test set (seeded)."""
    positive_rating: int = field(default=4, metadata={"min": 1, "max": 5})
    """label = rating >= this (seed 001: 4)."""


@dataclass(frozen=True)
class Layout:
    folder: str
    ratings: str
    users: str
    movies: str
    separator: str


LAYOUTS = {
    "movielens-100k": Layout("ml-100k", "u.data", "u.user", "u.item", "\t"),
    "movielens-1m": Layout("ml-1m", "ratings.dat", "users.dat", "movies.dat", "::"),
}


def age_group(age: int) -> int:
    """ML-1M's age code for an age in years (ML-100K)."""
    bounds = (18, 25, 35, 45, 50, 56)
    return AGE_GROUPS[sum(age >= b for b in bounds)]


class Source:
    """Reads member files of a dataset from an extracted folder or its zip archive."""

    def __init__(self, name: str, path: str | None) -> None:
        layout = LAYOUTS[name]
        located = Path(path) if path else cached_file(name)
        if located is None:
            raise DataError(
                f"{name}: no data. Run `fedsub data fetch {name}`, or set data.path to the "
                f"{layout.folder}.zip archive or its extracted folder (with {layout.ratings}, "
                f"{layout.users}, {layout.movies})"
            )
        if not located.exists():
            raise DataError(f"{name}: data.path {located} does not exist")
        self.name, self.root, self.layout = name, located, layout

    def lines(self, member: str, encoding: str) -> Iterator[tuple[str, int, str]]:
        """(where, line number, text) for each non-empty line of a member file."""
        if self.root.is_dir():
            path = self.root / member
            if not path.exists() and (self.root / self.layout.folder / member).exists():
                path = self.root / self.layout.folder / member
            if not path.exists():
                raise DataError(f"{self.name}: {path} is missing")
            raw, where = path.read_bytes(), str(path)
        else:
            try:
                with zipfile.ZipFile(self.root) as archive:
                    inner = f"{self.layout.folder}/{member}"
                    raw, where = archive.read(inner), f"{self.root}:{inner}"
            except KeyError:
                raise DataError(f"{self.name}: {self.root} has no {inner}") from None
            except (zipfile.BadZipFile, OSError) as error:
                raise DataError(
                    f"{self.name}: {self.root} is not a readable zip ({error})"
                ) from None
        try:
            text = raw.decode(encoding)
        except UnicodeDecodeError as error:
            raise DataError(f"{where}: not {encoding} text ({error})") from None
        for number, line in enumerate(io.StringIO(text), start=1):
            line = line.rstrip("\r\n")
            if line.strip():
                yield where, number, line


def _fields(where: str, number: int, line: str, separator: str, count: int, what: str):
    parts = line.split(separator)
    if len(parts) != count:
        raise DataError(
            f"{where}, line {number}: expected {count} fields separated by {separator!r} "
            f"({what}), got {len(parts)}: {line[:80]!r}"
        )
    return parts


def _integer(where: str, number: int, text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DataError(
            f"{where}, line {number}: {what} must be an integer, got {text!r}"
        ) from None


def load(name: str, options: MovieLensOptions, path: str | None, seed: int) -> FederatedDataset:
    source = Source(name, path)
    users = _read_users(source)
    movies = _read_movies(source)
    ratings = _read_ratings(source, users, movies)
    ids, rows = _one_hot_ids(ratings, users, movies)
    labels = (ratings[:, 2] >= options.positive_rating).astype(np.float32)

    rng = np.random.default_rng([seed, 0x4D4C])
    is_test = rng.random(len(ratings)) < options.test_fraction
    order = np.argsort(ratings[:, 0], kind="stable")
    train_order = order[~is_test[order]]
    _, counts = np.unique(ratings[train_order, 0], return_counts=True)
    train = SampleSet({TABLE: Ragged.from_fixed(ids[train_order])}, labels[train_order])
    test = SampleSet({TABLE: Ragged.from_fixed(ids[is_test])}, labels[is_test])
    offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    return FederatedDataset(name, {TABLE: rows}, train, offsets, test)


def _ml1m(source: Source) -> bool:
    return source.name == "movielens-1m"


def _read_users(source: Source) -> dict[int, tuple[int, int]]:
    """user -> (gender 0/1, age group index)."""
    ml1m = _ml1m(source)
    users: dict[int, tuple[int, int]] = {}
    user_fields = (
        "user, gender, age, occupation, zip" if ml1m else "user, age, gender, occupation, zip"
    )
    for where, number, line in source.lines(source.layout.users, "latin-1"):
        parts = _fields(where, number, line, "::" if ml1m else "|", 5, user_fields)
        user = _integer(where, number, parts[0], "user id")
        gender_text, age_text = (parts[1], parts[2]) if ml1m else (parts[2], parts[1])
        if gender_text not in ("M", "F"):
            raise DataError(f"{where}, line {number}: gender must be M or F, got {gender_text!r}")
        age = _integer(where, number, age_text, "age")
        code = age if ml1m else age_group(age)
        if code not in AGE_GROUPS:
            raise DataError(
                f"{where}, line {number}: age code must be one of {AGE_GROUPS}, got {age}"
            )
        users[user] = (int(gender_text == "F"), AGE_GROUPS.index(code))
    return users


def _read_movies(source: Source) -> set[int]:
    movies = set()
    separator = "::" if _ml1m(source) else "|"
    for where, number, line in source.lines(source.layout.movies, "latin-1"):
        movies.add(_integer(where, number, line.split(separator, 1)[0], "movie id"))
    return movies


def _read_ratings(
    source: Source, users: dict[int, tuple[int, int]], movies: set[int]
) -> np.ndarray:
    """(user, movie, rating) rows, every user and movie known and every rating 1..5."""
    layout = source.layout
    records = []
    for where, number, line in source.lines(layout.ratings, "latin-1"):
        parts = _fields(where, number, line, layout.separator, 4, "user, movie, rating, timestamp")
        user, movie, rating = (
            _integer(where, number, p, w)
            for p, w in zip(parts[:3], ("user id", "movie id", "rating"), strict=True)
        )
        if user not in users:
            raise DataError(f"{where}, line {number}: user {user} is not in {layout.users}")
        if movie not in movies:
            raise DataError(f"{where}, line {number}: movie {movie} is not in {layout.movies}")
        if not 1 <= rating <= 5:
            raise DataError(f"{where}, line {number}: rating must be 1..5, got {rating}")
        records.append((user, movie, rating))
    if not records:
        raise DataError(f"{source.name}: {layout.ratings} has no ratings")
    return np.array(records, dtype=np.int64)


def _one_hot_ids(
    ratings: np.ndarray, users: dict[int, tuple[int, int]], movies: set[int]
) -> tuple[np.ndarray, int]:
    """Each rating's five feature rows (gender, age group, movie, gender x movie, age group x
    movie) in the one feature table, and the table's size."""
    movie_ids = np.array(sorted(movies))
    rated = np.searchsorted(movie_ids, ratings[:, 1])
    m = len(movie_ids)
    rater_gender = np.array([users[u][0] for u in ratings[:, 0]])
    rater_age = np.array([users[u][1] for u in ratings[:, 0]])
    starts = np.cumsum([0, 2, len(AGE_GROUPS), m, 2 * m])
    ids = np.stack(
        [
            starts[0] + rater_gender,
            starts[1] + rater_age,
            starts[2] + rated,
            starts[3] + rater_gender * m + rated,
            starts[4] + rater_age * m + rated,
        ],
        axis=1,
    )
    return ids, int(starts[4] + len(AGE_GROUPS) * m)
