"""A synthetic interaction log with structure a model can learn and a test can check.

Planted structure:
- every item belongs to one of `num_clusters` clusters (its primary genre) and has a power-law
  popularity rank inside it;
- every user prefers a few clusters (Dirichlet weights; the user's `segment` attribute is the
  favourite cluster, bucketed);
- sessions: with probability `sequential_prob` the next item is one of the `num_successors`
  items that follow the previous item in its cluster's fixed order, so history matters;
- ratings are higher for items of the user's favourite cluster;
- popularity drift (`popularity_drift` > 0): the popular items of every cluster change over the
  year, the power-law ranks rotating through the cluster's order with the user's start day, so
  what is popular late in the log differs from what was popular early.

Generation runs one vectorised step per position in the longest user sequence, over all users
at once; 10 million interactions take well under a minute. `write_shards` writes a log of any
size to Parquet shards in bounded memory, a chunk of users at a time:

    python -m tworec.features.shards --synthetic 100m --out logs/synthetic-100m
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tworec.features.interactions import Interactions

DAY = 86_400


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """Sizes and strengths of the planted structure."""

    num_users: int = 2_000
    num_items: int = 1_000
    num_interactions: int = 100_000
    num_clusters: int = 10
    num_genres: int = 12
    popularity_exponent: float = 3.0   # rank = size * u**exponent: larger is more skewed
    user_concentration: float = 0.3    # Dirichlet alpha of cluster preferences: smaller is sharper
    sequential_prob: float = 0.6
    num_successors: int = 3
    popularity_drift: float = 0.0      # share of a cluster the popular ranks rotate over a year
    start_time: int = 1_600_000_000


PRESETS = {
    "tiny": SyntheticConfig(num_users=200, num_items=150, num_interactions=6_000, num_clusters=5),
    "default": SyntheticConfig(),
    # Another structure: weak sessions, broader tastes, and what is popular drifts over the year.
    "drift": SyntheticConfig(sequential_prob=0.25, user_concentration=0.6, popularity_drift=1.0),
    "1m": SyntheticConfig(num_users=20_000, num_items=10_000, num_interactions=1_000_000,
                          num_clusters=20),
    "10m": SyntheticConfig(num_users=100_000, num_items=50_000, num_interactions=10_000_000,
                           num_clusters=50, num_genres=20),
    "100m": SyntheticConfig(num_users=1_000_000, num_items=200_000,
                            num_interactions=100_000_000, num_clusters=100, num_genres=20),
}
SHARDS_ONLY = frozenset({"100m"})     # written by `write_shards`, too large for `generate`
ROWS_PER_SHARD = 1_000_000


def generate(config: SyntheticConfig = SyntheticConfig(), seed: int = 0,
             name: str = "synthetic") -> Interactions:
    """Generates a log of at most `config.num_interactions` rows, deterministic for a seed:
    repeats of a user-item pair are removed (a fifth of the default preset's rows, a third of
    the tiny one's)."""
    rng = np.random.default_rng(seed)
    items = _items(config, rng)
    start_day = (np.random.default_rng([seed, 1]).integers(0, 365, config.num_users)
                 if config.popularity_drift else None)      # its own stream: default unchanged
    users, chosen, timestamp, rating, favourite = _rows(config, rng, items, start_day)
    item_features = _item_features(config, rng, *items[:2])
    user_ids = np.char.add("u", np.arange(config.num_users).astype(str))
    return Interactions(
        user_ids=user_ids, item_ids=_item_ids(config), user=users.astype(np.int32),
        item=chosen.astype(np.int32), timestamp=timestamp, rating=rating,
        item_features=item_features,
        user_features={"segment": np.char.add("s", (favourite % 8).astype(str)),
                       "age": np.char.add("a", rng.integers(0, 6, config.num_users).astype(str))},
        genre_names=_genre_names(config), source=f"{name}(seed={seed})")


def planted_scores(config: SyntheticConfig, seed: int, log: Interactions,
                   rows: np.ndarray) -> np.ndarray:
    """[len(rows), num_items] the generator's own probability of each item being the user's
    next logged item at each row of `log` (= `generate(config, seed)`): the Bayes scorer of the
    planted structure, the ceiling a model's figures on this log can be read against.

    One step of the generator draws a successor of the previous item (`sequential_prob`) or an
    item from the user's cluster preferences times the (drifting) popularity law; the log keeps
    first occurrences only, so the next logged item is the first item outside the user's seen
    set S that the chain reaches from the latest item x: e_x' (I - T_SS)^-1 T over the items
    outside S (T: the user's one-step matrix). A user's first row is one draw. Over the items
    the user has not had, every row sums to 1.
    """
    rng = np.random.default_rng(seed)
    cluster, position, cluster_items = _items(config, rng)
    preference = rng.dirichlet(np.full(config.num_clusters, config.user_concentration),
                               size=config.num_users)                     # [users, clusters]
    sizes = np.bincount(cluster, minlength=config.num_clusters)[cluster]    # [items]
    following = np.stack([np.concatenate([np.roll(members, -hop) for members in cluster_items])
                          for hop in range(1, config.num_successors + 1)], 1)  # [items, hops]
    successors = np.empty_like(following)       # by item code (`following`: cluster order)
    successors[np.concatenate(cluster_items)] = following
    start_day = (np.random.default_rng([seed, 1]).integers(0, 365, config.num_users)
                 if config.popularity_drift else None)
    power = 1.0 / config.popularity_exponent     # P(rank <= r) = ((r + 1) / size) ** power
    order = log.time_order()
    place = np.empty(len(log), np.int64)
    place[order] = np.arange(len(log))
    first_of_user = np.searchsorted(log.user[order], log.user[order], side="left")
    follow, hops = config.sequential_prob, config.num_successors
    scores = np.zeros((len(rows), config.num_items))
    for out, row in enumerate(rows):
        user = log.user[row]
        rank = position.astype(np.float64)
        if start_day is not None:                # ranks rotated by the user's start day
            rank = (rank - np.floor(sizes * config.popularity_drift * start_day[user] / 365)) \
                % sizes
        draw = preference[user][cluster] * (((rank + 1) / sizes) ** power - (rank / sizes) ** power)
        seen = log.item[order[first_of_user[place[row]]:place[row]]]           # [S], in time
        if not len(seen):
            scores[out] = draw
            continue
        step = np.tile((1 - follow) * draw[seen], (len(seen), 1))             # T_SS [S, S]
        index = {item: i for i, item in enumerate(seen)}
        for i, item in enumerate(seen):
            for successor in successors[item]:
                if successor in index:
                    step[i, index[successor]] += follow / hops
        start = np.zeros(len(seen))
        start[-1] = 1.0
        visits = np.linalg.solve((np.eye(len(seen)) - step).T, start)        # [S]
        scores[out] = visits.sum() * (1 - follow) * draw
        np.add.at(scores[out], successors[seen].ravel(), np.repeat(visits, hops) * follow / hops)
        scores[out, seen] = 0.0                   # never the next logged item
    return scores.astype(np.float32)


def _rows(config: SyntheticConfig, rng: np.random.Generator, items, start_day=None):
    """The rows of `config.num_users` users drawn from `rng` over the shared `items` (as
    `_items` returns them).

    Returns:
        users [n] int in 0..num_users-1, items [n] int, timestamp [n] int64, rating [n] float32
        in (user, step) order, and each user's favourite cluster [num_users].
    """
    cluster, position_in_cluster, cluster_items = items
    preference = rng.dirichlet(np.full(config.num_clusters, config.user_concentration),
                               size=config.num_users).astype(np.float32)   # [users, clusters]
    lengths = _sequence_lengths(config, rng)
    users, chosen = _sequences(config, rng, lengths, preference, cluster, position_in_cluster,
                               cluster_items, start_day)
    users, chosen = _first_occurrences(users, chosen, config.num_items)
    timestamp = _timestamps(config, rng, users, start_day)
    affinity = preference[users, cluster[chosen]]                           # [n]
    rating = np.clip(np.rint(2.2 + 4.0 * affinity + rng.normal(0, 0.7, len(users))), 1, 5)
    return users, chosen, timestamp, rating.astype(np.float32), preference.argmax(1)


def _item_features(config: SyntheticConfig, rng: np.random.Generator, cluster: np.ndarray,
                   position_in_cluster: np.ndarray) -> dict[str, np.ndarray]:
    """genres [items, num_genres] float32 multi-hot (the cluster's, and a second one for 30%
    of items), year [items] int32 and title [items] str."""
    genres = np.zeros((config.num_items, config.num_genres), dtype=np.float32)
    genres[np.arange(config.num_items), cluster % config.num_genres] = 1.0
    secondary = rng.random(config.num_items) < 0.3
    genres[np.flatnonzero(secondary), rng.integers(0, config.num_genres, secondary.sum())] = 1.0
    return {"genres": genres, "year": (1950 + position_in_cluster % 70).astype(np.int32),
            "title": np.char.add("Item ", np.arange(config.num_items).astype(str))}


def write_shards(config: SyntheticConfig, folder: str, seed: int = 0,
                 rows_per_shard: int = ROWS_PER_SHARD, progress=None) -> list[str]:
    """Writes a log of about `config.num_interactions` rows to Parquet shards, a chunk of users
    at a time, in memory bounded by the chunk: `part-NNNNN.parquet` per chunk (user_id,
    item_id, timestamp, rating) and `items.parquet` (item_id, genres, year, title), which
    `features.load(folder)` reads back. Deterministic for a seed: the items and clusters are
    drawn from `seed` and shared, each chunk's users from its own seed derived from (seed,
    chunk index) by `chunk_table`. Not the log `generate` draws for the same seed.

    Args:
        config: the sizes; `num_users` is split into chunks of about `rows_per_shard` rows.
        folder: a new or empty folder; the shards appear in it only once all are written.
        rows_per_shard: rows of a chunk before repeats of a user-item pair are removed.
        progress: called as progress(path, rows) after each shard, or None.

    Returns:
        The paths of the shards, in order.
    """
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be at least 1, got {rows_per_shard}")
    if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
        raise FileExistsError(f"{folder}: already exists and is not an empty folder; write the "
                              "shards into a new one")
    from tworec.features.shards import ITEM_TABLE, write_item_table
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    partial = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.partial-", dir=parent)
    try:
        rng = np.random.default_rng(seed)
        items = _items(config, rng)
        write_item_table(os.path.join(partial, ITEM_TABLE), _item_ids(config),
                         _item_features(config, rng, *items[:2]), _genre_names(config))
        users_per_chunk = users_per_shard(config, rows_per_shard)
        names = []
        for chunk in range(-(-config.num_users // users_per_chunk)):
            table = chunk_table(config, seed, chunk, users_per_chunk, items)
            names.append(f"part-{chunk:05d}.parquet")
            pq.write_table(table, os.path.join(partial, names[-1]))
            if progress is not None:
                progress(os.path.join(folder, names[-1]), table.num_rows)
            del table
        if os.path.isdir(folder):
            os.rmdir(folder)
        os.replace(partial, folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return [os.path.join(folder, name) for name in names]


def users_per_shard(config: SyntheticConfig, rows_per_shard: int) -> int:
    """Users of a chunk of about `rows_per_shard` rows."""
    return max(1, rows_per_shard * config.num_users // config.num_interactions)


def chunk_table(config: SyntheticConfig, seed: int, chunk: int, users_per_chunk: int,
                items=None) -> pa.Table:
    """The rows of users `chunk * users_per_chunk` up to the next chunk's first (or
    `config.num_users`), drawn from a seed derived from (seed, chunk) over the items drawn
    from `seed`: a function of its own chunk only, whatever the number of chunks.

    Returns:
        user_id string, item_id string, timestamp int64 and rating float32 columns, [rows].
    """
    items = _items(config, np.random.default_rng(seed)) if items is None else items
    first = chunk * users_per_chunk
    size = min(users_per_chunk, config.num_users - first)
    if size <= 0:
        raise ValueError(f"chunk {chunk} of {users_per_chunk} users is past the "
                         f"{config.num_users} users")
    local = dataclasses.replace(config, num_users=size, num_interactions=round(
        config.num_interactions * size / config.num_users))
    rng, days = (np.random.default_rng(s) for s in np.random.SeedSequence([seed, chunk]).spawn(2))
    start_day = days.integers(0, 365, size) if config.popularity_drift else None
    users, chosen, timestamp, rating, _ = _rows(local, rng, items, start_day)
    return pa.table({"user_id": _prefixed("u", users + first), "item_id": _prefixed("i", chosen),
                     "timestamp": timestamp, "rating": rating})


def _prefixed(prefix: str, codes: np.ndarray) -> pa.Array:
    """[n] strings `prefix` + code, the ids `generate` gives."""
    return pc.binary_join_element_wise(prefix, pc.cast(pa.array(codes), pa.string()), "")


def _item_ids(config: SyntheticConfig) -> np.ndarray:
    return np.char.add("i", np.arange(config.num_items).astype(str))


def _genre_names(config: SyntheticConfig) -> tuple[str, ...]:
    return tuple(f"genre{g}" for g in range(config.num_genres))


def _items(config: SyntheticConfig, rng: np.random.Generator):
    """Cluster of each item [items], its position in the cluster's order [items], and the
    items of each cluster in that order (list of [size] arrays)."""
    cluster = rng.integers(0, config.num_clusters, config.num_items)
    cluster_items = [rng.permutation(np.flatnonzero(cluster == c)) for c in range(config.num_clusters)]
    position = np.zeros(config.num_items, dtype=np.int64)
    for members in cluster_items:
        position[members] = np.arange(len(members))
    return cluster, position, cluster_items


def _sequence_lengths(config: SyntheticConfig, rng: np.random.Generator) -> np.ndarray:
    """[users] int lengths, log-normal around the mean, at least 3, summing to about n."""
    raw = rng.lognormal(0.0, 0.8, config.num_users)
    lengths = np.maximum(3, np.rint(raw / raw.sum() * config.num_interactions)).astype(np.int64)
    return np.minimum(lengths, max(3, config.num_items // 2))


def _sequences(config, rng, lengths, preference, cluster, position_in_cluster, cluster_items,
               start_day=None):
    """Walks every user's sequence one step at a time, all users at once. With `start_day`
    [users] the popular ranks of each cluster are rotated by `popularity_drift` of its size per
    year of the user's start day.

    Returns:
        users [n] and items [n] in (user, step) order.
    """
    sizes = np.array([len(m) for m in cluster_items])
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    ordered = np.concatenate(cluster_items)                  # items grouped by cluster, in order
    cumulative = np.cumsum(preference, axis=1)               # [users, clusters]
    max_length = int(lengths.max())
    sequence = np.zeros((config.num_users, max_length), dtype=np.int64)
    previous = None
    for step in range(max_length):
        draw = (rng.random((config.num_users, 1)) > cumulative[:, :-1]).sum(1)   # [users]
        draw = np.where(sizes[draw] > 0, draw, cluster[rng.integers(0, config.num_items,
                                                                    config.num_users)])
        rank = np.floor(sizes[draw] * rng.random(config.num_users) ** config.popularity_exponent)
        if start_day is not None:
            rank = rank + np.floor(sizes[draw] * config.popularity_drift * start_day / 365)
        item = ordered[offsets[draw] + rank.astype(np.int64) % sizes[draw]]
        if previous is not None:
            follow = rng.random(config.num_users) < config.sequential_prob
            c = cluster[previous]
            hop = rng.integers(1, config.num_successors + 1, config.num_users)
            successor = ordered[offsets[c] + (position_in_cluster[previous] + hop) % sizes[c]]
            item = np.where(follow, successor, item)
        sequence[:, step] = item
        previous = item
    active = np.arange(max_length)[None, :] < lengths[:, None]          # [users, max_length]
    users = np.broadcast_to(np.arange(config.num_users)[:, None], active.shape)[active]
    return users, sequence[active]


def _first_occurrences(users, items, num_items):
    """Keeps each user's first interaction with an item, in (user, step) order."""
    key = users.astype(np.int64) * num_items + items
    _, first = np.unique(key, return_index=True)
    first.sort()
    return users[first], items[first]


def _timestamps(config, rng, users, start_day=None):
    """[n] int64: each user starts on a random day of a year (`start_day` [users] when given)
    and rates in sessions."""
    start = config.start_time + (rng.integers(0, 365 * DAY, users.max() + 1) if start_day is None
                                 else start_day * DAY + rng.integers(0, DAY, len(start_day)))
    gaps = np.where(rng.random(len(users)) < 0.1, rng.exponential(3 * DAY, len(users)),
                    rng.exponential(120, len(users))).astype(np.int64) + 1
    boundaries = np.flatnonzero(np.diff(users, prepend=-1))
    elapsed = np.cumsum(gaps)
    elapsed -= np.repeat(elapsed[boundaries] - gaps[boundaries], np.diff(np.append(boundaries, len(users))))
    return start[users] + elapsed

