"""The ranker's pair features and the signals they come from.

Besides the model inputs, the ranker reads five signals, handed over as one `RankingSignals`
object to `list_examples` (training and evaluation) and to the export (baked into the graph):
the retrieval stage's embeddings (ranking never imports retrieval: they arrive as arrays), the
item-to-next-item transition counts and the item-item co-occurrence similarities of the training
rows, the items' popularity by period of the rows known before each held-out part, and the
similarity of the items' titles (from the item table, not the log).
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import scipy.sparse as sp
import tensorflow as tf

from tworec.features.history import previous_items, transition_counts
from tworec.features.inputs import EMPTY_SLOT, ModelInputs
from tworec.features.vocab import FIRST
from tworec.ranking.config import RankingConfig


@dataclasses.dataclass(frozen=True)
class RankingSignals:
    """What the ranker reads besides `ModelInputs`.

    Attributes:
        retrieval_queries: part -> [m, e] the retrieval query embedding of every row of that
            part, or None without the retrieval signal.
        retrieval_latest: [num_users, e] every user's retrieval query embedding from their
            latest history (what serving sees), or None.
        retrieval_items: [num_items, e] the retrieval item embeddings, or None.
        transitions: [V, V] CSR over item vocabulary indexes (`transition_matrix`), or None.
        cooccurrence: the item-item similarities (`Cooccurrence`), or None.
        popularity: the items' popularity by period (`PeriodPopularity`), or None.
        titles: the title similarities (`TitleSimilarity`), or None.
    """

    retrieval_queries: dict[str, np.ndarray] | None = None
    retrieval_latest: np.ndarray | None = None
    retrieval_items: np.ndarray | None = None
    transitions: sp.csr_matrix | None = None
    cooccurrence: Cooccurrence | None = None
    popularity: PeriodPopularity | None = None
    titles: TitleSimilarity | None = None

    @property
    def has_retrieval(self) -> bool:
        return self.retrieval_items is not None


def signals(data: ModelInputs, config: RankingConfig, retrieval: dict | None = None
            ) -> RankingSignals:
    """The signals `config` asks for: `retrieval` holds the retrieval stage's `queries`
    (part -> [m, e]), `latest` ([num_users, e]) and `items` ([num_items, e]) arrays (left out
    when `config.use_retrieval_score` is off)."""
    retrieval = (retrieval or {}) if config.use_retrieval_score else {}
    return RankingSignals(
        retrieval_queries=retrieval.get("queries"), retrieval_latest=retrieval.get("latest"),
        retrieval_items=retrieval.get("items"),
        transitions=transition_matrix(data) if config.use_transitions else None,
        cooccurrence=(cooccurrence(data, config.cooccurrence_neighbors, config.cooccurrence_folds,
                                   config.seed) if config.cooccurrence_neighbors else None),
        popularity=(period_popularity(data, config.held_out_periods)
                    if config.held_out_periods else None),
        titles=title_signal(data, config))


def title_signal(data: ModelInputs, config: RankingConfig) -> TitleSimilarity | None:
    """The title similarities `config` asks for, with its title candidates; None for none."""
    titles = (title_similarities(data, config.held_out_title_neighbors)
              if config.held_out_title_neighbors else None)
    if titles is None:
        return None
    history = min(config.title_candidate_history, data.history_length)
    count = config.added_title_candidates if history else 0
    return dataclasses.replace(titles, candidates=count, candidate_history=history,
                               candidate_matrix=fit_item_columns(titles.matrix, data)
                               if count else None)


def fit_item_columns(matrix: sp.csr_matrix, data: ModelInputs) -> sp.csr_matrix:
    """[V, num_items] `matrix` with only the entries of the training rows' items (the item
    vocabulary: those with an embedding of their own)."""
    kept = matrix.tocoo()
    fit = data.item_index[kept.col] >= FIRST
    return sp.csr_matrix((kept.data[fit], (kept.row[fit], kept.col[fit])), shape=matrix.shape)


def transition_matrix(data: ModelInputs) -> sp.csr_matrix:
    """[V, V] CSR over item vocabulary indexes: how often item j directly followed item i in a
    user's time-ordered training rows."""
    counts = transition_counts(data.interactions, data.split.train).tocoo()      # catalogue codes
    size = data.items.size
    return sp.csr_matrix((counts.data, (data.item_index[counts.row], data.item_index[counts.col])),
                         shape=(size, size))


def transition_features(transitions: sp.csr_matrix, data: ModelInputs, part: str,
                        items: np.ndarray) -> np.ndarray:
    """[m, n] float32 log(1 + how often each candidate followed the row's latest history item
    in training). Training rows leave their own transition out, so that the feature means on
    them what it means on held-out rows and at serving time. (A training row's counts still
    include the training transitions after its time, the user's and, under `global`, other
    users' too, which a held-out row there cannot see: about half the counts training rows
    read on the default synthetic data. Under `temporal` a held-out row reads other users'
    later training rows as well. Counting only earlier transitions would need a matrix per
    time; the calibration on validation rows weighs the feature as held-out rows read it.)"""
    last = data.examples[part]["history"][:, -1]                               # [m] vocab index
    candidates = data.item_index[items]                                        # [m, n]
    counts = np.asarray(transitions[last[:, None], candidates].todense(), np.float32)
    if part == "train":
        own = (items == data.examples[part]["item"][:, None]) & counted_from(data, last)[:, None]
        counts -= own
    return np.log1p(counts)


def counted_from(data: ModelInputs, last: np.ndarray) -> np.ndarray:
    """[m] bool per training row: whether `transition_matrix` counted the row's own
    transition from `last` (its latest history item): the user's previous training row
    exists and holds that item. Under the temporal split that holds for all but each user's
    first row; under the random split the previous row in time may be a test row."""
    previous = previous_items(data.interactions, data.split.train)             # codes, -1: none
    return (previous >= 0) & (data.item_index[np.maximum(previous, 0)] == last)


@dataclasses.dataclass(frozen=True)
class Cooccurrence:
    """Item-item cosine similarities of the training rows (`similarities`).

    A fold's matrix comes from about (k - 1) / k of the users, so its pairs that clear the
    two-user cut are fewer than the full matrix's (on ml-latest-small, 5 folds: 15% fewer);
    cosines keep their scale. Building them costs the sum over users of their item count
    squared (X^T X): fine for ml-latest-small (22M pairs, 4 s), too much for logs of heavy
    users in the tens of millions.

    Attributes:
        full: [V, V] CSR over item vocabulary indexes, from every training row: what held-out
            rows and serving read.
        folds: [k] such matrices, fold f's without the rows of the users of fold f: what the
            training rows of those users read, so that no training row sees its own user's
            items (their later ones included) in its feature.
        fold_of_user: [num_users] the fold of every user code.
        neighbors, seed: the settings the matrices were built with.
    """

    full: sp.csr_matrix
    folds: tuple[sp.csr_matrix, ...]
    fold_of_user: np.ndarray
    neighbors: int
    seed: int


def cooccurrence(data: ModelInputs, neighbors: int, folds: int, seed: int = 0) -> Cooccurrence:
    """The co-occurrence similarities of the training rows, whole and out of each user fold."""
    rows = data.split.train
    fold_of_user = np.random.default_rng(seed).permutation(data.interactions.num_users) % folds
    counts = user_item_matrix(data, rows)
    together = (counts.T @ counts).tocsr()                                       # [V, V]
    out_of_fold = []
    for fold in range(folds):
        own = user_item_matrix(data, rows[fold_of_user[data.interactions.user[rows]] == fold])
        out_of_fold.append(similarities(together - (own.T @ own), neighbors))
    return Cooccurrence(similarities(together, neighbors), tuple(out_of_fold), fold_of_user,
                        neighbors, seed)


def user_item_matrix(data: ModelInputs, rows: np.ndarray) -> sp.csr_matrix:
    """[num_users, V] float32 CSR: 1 where the user has the item (vocabulary index) in `rows`."""
    users = data.interactions.user[rows]
    matrix = sp.csr_matrix((np.ones(len(rows), np.float32),
                            (users, data.item_index[data.interactions.item[rows]])),
                           shape=(data.interactions.num_users, data.items.size))
    matrix.data[:] = 1.0                                       # repeated rows count once
    return matrix


def similarities(together: sp.csr_matrix, neighbors: int, min_users: int = 2) -> sp.csr_matrix:
    """[V, V] float32 CSR: the cosine similarity of items i and j, together[i, j] /
    sqrt(together[i, i] * together[j, j]) (users with both over the root of each one's users),
    kept for pairs that at least `min_users` users share (one user's coincidence is noise) and
    for the `neighbors` most similar j of every i."""
    users = together.diagonal()
    pairs = together.tocoo()
    keep = (pairs.row != pairs.col) & (pairs.data >= min_users)
    row, col = pairs.row[keep], pairs.col[keep]
    value = (pairs.data[keep] / np.sqrt(users[row] * users[col])).astype(np.float32)
    return sp.csr_matrix(most_similar(row, col, value, neighbors), shape=together.shape)


def most_similar(row: np.ndarray, col: np.ndarray, value: np.ndarray, neighbors: int
                 ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """The entries (value, (row, col)) among [k] ones of the `neighbors` highest values of
    every row, ties to the lower column."""
    order = np.lexsort((col, -value, row))                   # by row, most similar first
    row, col, value = row[order], col[order], value[order]
    rank = np.arange(len(row)) - np.searchsorted(row, row)
    best = rank < neighbors
    return value[best], (row[best], col[best])


def pair_keys(matrix: sp.csr_matrix) -> tuple[np.ndarray, np.ndarray]:
    """The entries of a [V, V] matrix as increasing int64 keys row * V + column and their
    float32 values (what the export's `pair_table` holds), each ended by a key no lookup
    reaches."""
    coo = matrix.tocoo()
    keys = coo.row.astype(np.int64) * matrix.shape[1] + coo.col
    order = np.argsort(keys)
    return (np.append(keys[order], np.iinfo(np.int64).max),
            np.append(coo.data[order], 0.0).astype(np.float32))


def pair_values(keys: tuple[np.ndarray, np.ndarray], size: int, previous: np.ndarray,
                candidates: np.ndarray) -> np.ndarray:
    """[m, L, n] float32 matrix[previous[r, l], candidates[r, n]] (vocabulary indexes below
    `size`; 0 where the matrix holds no value) from the matrix's `pair_keys`, as the export's
    hash table looks them up."""
    ordered, values = keys
    wanted = previous[:, :, None] * size + candidates[:, None, :]                 # [m, L, n]
    at = np.searchsorted(ordered, wanted)
    return np.where(ordered[at] == wanted, values[at], np.float32(0.0))


def sum_in_order(values: np.ndarray | tf.Tensor) -> np.ndarray | tf.Tensor:
    """[m, L, n] -> [m, n]: the sum over L, slot by slot from the oldest, so that NumPy here and
    TF in the export add the same float32 numbers in the same order (equal bits)."""
    total = values[:, 0]
    for slot in range(1, values.shape[1]):
        total = total + values[:, slot]
    return total


def history_pairs(matrix: sp.csr_matrix, history: np.ndarray, candidates: np.ndarray,
                  reduce, chunk: int = 4096) -> np.ndarray:
    """[m, n] float32 `reduce` ([m, L, n] -> [m, n]) of matrix[history[r, l], candidates[r, n]]
    over the history slots, `chunk` rows at a time (bounded memory)."""
    keys = pair_keys(matrix)
    features = np.zeros(candidates.shape, np.float32)
    for start in range(0, len(history), chunk):
        at = slice(start, start + chunk)
        features[at] = reduce(pair_values(keys, matrix.shape[1], history[at], candidates[at]))
    return features


def cooccurrence_features(signal: Cooccurrence, data: ModelInputs, part: str,
                          items: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """[m, n] float32: the sum of each candidate's similarities to the row's history items
    (the latest L). Training rows read their user fold's matrix, other rows the full one."""
    history = data.examples[part]["history"]                                   # [m, L] vocab
    candidates = data.item_index[items]                                        # [m, n]
    if part == "train":
        users = data.interactions.user[data.split.train]
        fold = signal.fold_of_user[users]
        matrices = [(signal.folds[f], fold == f) for f in range(len(signal.folds))]
    else:
        matrices = [(signal.full, np.ones(len(history), bool))]
    features = np.zeros(candidates.shape, np.float32)
    for matrix, rows in matrices:
        features[rows] = history_pairs(matrix, history[rows], candidates[rows], sum_in_order,
                                       chunk)
    return features


@dataclasses.dataclass(frozen=True)
class PeriodPopularity:
    """The items' popularity in equal-row periods of the rows known before a held-out part
    (training rows for validation; training and validation rows for test, what an export
    knows; the known rows in time order, ties in log order, so that a cut may part rows of
    one timestamp; with fewer known rows than periods some periods stay empty), for the two
    held-out signals: "recent_popularity", the last period's, and
    "user_time_popularity", the period's of the user's latest known row (when the user was last
    active: what was popular then). Held-out only: the ranker never trains on them; calibration
    alone weighs them, on validation's served lists.

    Attributes:
        tables: part -> [P, num_items] float32 log(1 + count * V / rows of the period), the
            item's count over that of an item of average share (V: the size of the item
            vocabulary, a constant of the run).
        user_period: part -> [num_users] int64 the period of each user's latest known row
            (the last period for users without known rows).
    """

    tables: dict[str, np.ndarray]
    user_period: dict[str, np.ndarray]

    @property
    def periods(self) -> int:
        return self.tables["test"].shape[0]


POPULARITY_SIGNALS = ("recent_popularity", "user_time_popularity")


def period_popularity(data: ModelInputs, periods: int) -> PeriodPopularity:
    """The popularity tables of the validation and test parts: the known rows in time order
    (ties in log order) cut into `periods` parts of equal row count."""
    log, tables, user_period = data.interactions, {}, {}
    for part, known in (("validation", data.split.train), ("test", data.split.fit)):
        rows = known[np.argsort(log.timestamp[known], kind="stable")]
        period = np.arange(len(rows)) * periods // max(len(rows), 1)             # [k]
        counts = np.bincount(period * log.num_items + log.item[rows],
                             minlength=periods * log.num_items).reshape(periods, log.num_items)
        rows_per_period = np.maximum(np.bincount(period, minlength=periods), 1)[:, None]
        tables[part] = np.log1p(counts * data.items.size / rows_per_period).astype(np.float32)
        latest = np.full(log.num_users, -1)
        np.maximum.at(latest, log.user[rows], np.arange(len(rows)))             # [U] position
        user_period[part] = np.append(period, periods - 1)[latest]      # -1: no row, the last
    return PeriodPopularity(tables, user_period)


def popularity_features(signal: PeriodPopularity, data: ModelInputs, part: str,
                        items: np.ndarray) -> dict[str, np.ndarray]:
    """The two popularity signals ([m, n] float32 each) of the candidates `items` [m, n] of the
    held-out rows of `part`."""
    table = signal.tables[part]                                                 # [P, I]
    users = data.interactions.user[getattr(data.split, part)]                   # [m]
    return {"recent_popularity": table[-1][items],
            "user_time_popularity": table[signal.user_period[part][users][:, None], items]}


TITLE_SIGNAL = "title_similarity"
TITLE_WORD_MAX_SHARE = 0.02      # words in more of the titles ("the", "of") are not read,
TITLE_WORD_MIN_LIMIT = 20        # unless no more titles than this have them (small catalogues)
TITLE_PAIRS_PER_BLOCK = 1 << 22  # title pairs multiplied at once, at most: ~50 B a pair


@dataclasses.dataclass(frozen=True)
class TitleSimilarity:
    """The items' title similarities (`title_similarities`).

    Attributes:
        matrix: [V, num_items] float32 CSR over item vocabulary indexes (rows: what a history
            holds) and catalogue codes (columns: what a candidate is, a new item too).
        neighbors: the similar titles kept per item.
        candidates: items added to each served list (`with_title_candidates`), 0 for none.
        candidate_history: the latest history items those are similar to.
        candidate_matrix: `matrix` with the columns of the training rows' items, which alone
            are added (the catalogue may list an item only because of later rows), or None.
    """

    matrix: sp.csr_matrix
    neighbors: int
    candidates: int = 0
    candidate_history: int = 0
    candidate_matrix: sp.csr_matrix | None = None


def title_words(titles: np.ndarray) -> sp.csr_matrix:
    """[num_items, W] float32 CSR: each title's words (lower case, runs of letters and digits,
    the trailing release year "(1995)" left out) weighted by log(items / items whose title has
    the word), rows of unit length (empty for a title without words). Words in more than
    `TITLE_WORD_MAX_SHARE` of the titles and more than `TITLE_WORD_MIN_LIMIT` titles are left
    out: they link items of no common series ("the" would link a third of a film catalogue's
    pairs)."""
    rows, words, vocabulary = [], [], {}
    for item, title in enumerate(titles):
        text = re.sub(r"\(\d{4}\)\s*$", "", str(title).lower())
        for word in sorted(set(re.findall(r"[^\W_]+", text))):
            rows.append(item)
            words.append(vocabulary.setdefault(word, len(vocabulary)))
    has = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, words)),
                        shape=(len(titles), len(vocabulary)))
    items_with = np.asarray(has.sum(0)).ravel()                                 # [W]
    kept = items_with <= max(TITLE_WORD_MAX_SHARE * len(titles), TITLE_WORD_MIN_LIMIT)
    weighted = has[:, kept] @ sp.diags(np.log(len(titles) / items_with[kept]).astype(np.float32))
    length = np.sqrt(np.asarray(weighted.multiply(weighted).sum(1)).ravel())   # [num_items]
    return (sp.diags((1 / np.where(length > 0, length, 1)).astype(np.float32)) @ weighted).tocsr()


def title_similarities(data: ModelInputs, neighbors: int,
                       pairs_per_block: int = TITLE_PAIRS_PER_BLOCK) -> TitleSimilarity | None:
    """The cosine of the titles' words (`title_words`) of a vocabulary item (a row) and a
    catalogue item (a column), kept for each item's `neighbors` most similar other items (ties
    to the lower code); None when no two titles share a word it reads (no titles, or the
    synthetic data's "Item N"). Built from the item table alone, not from the log: no row's
    value reads a later row. An item first seen after training has a column but no row (its
    history slots are out of the vocabulary). Blocks of items whose pairs with a common word
    number at most `pairs_per_block` (an item's own beyond it: alone) are multiplied at once."""
    titles = data.interactions.item_features.get("title")          # [I] str, or None
    if titles is None:
        return None
    words = title_words(titles)
    others = words.T.tocsr()                                                    # [W, I]
    pairs = np.cumsum((words != 0).astype(np.int64) @ others.getnnz(axis=1))   # [I] bound
    values, rows, columns, start = [], [], [], 0
    while start < words.shape[0]:
        done = pairs[start - 1] if start else 0
        end = max(int(np.searchsorted(pairs, done + pairs_per_block, side="right")), start + 1)
        block = (words[start:end] @ others).tocoo()                            # [c, I]
        row = block.row + start
        keep = (row != block.col) & (block.data > 0)
        value, (row, col) = most_similar(row[keep], block.col[keep], block.data[keep], neighbors)
        values.append(value)
        rows.append(row)
        columns.append(col)
        start = end
    row, col = np.concatenate(rows), np.concatenate(columns)
    in_vocabulary = data.item_index[row] >= FIRST
    if not in_vocabulary.any():
        return None
    return TitleSimilarity(
        sp.csr_matrix((np.concatenate(values)[in_vocabulary],
                       (data.item_index[row[in_vocabulary]], col[in_vocabulary])),
                      shape=(data.items.size, data.num_items), dtype=np.float32), neighbors)


def highest_in_history(values: np.ndarray) -> np.ndarray:
    """[m, L, n] -> [m, n]: the highest over the history slots (0 for none)."""
    return values.max(axis=1)


def title_features(titles: TitleSimilarity, data: ModelInputs, part: str,
                   items: np.ndarray) -> np.ndarray:
    """[m, n] float32: each candidate's (`items` [m, n] catalogue codes) highest title
    similarity to the row's history items (the latest L): whether it is of a series or of a
    kind of a title the user has."""
    return history_pairs(titles.matrix, data.examples[part]["history"], items,
                         highest_in_history)


def title_candidates(titles: TitleSimilarity, history: np.ndarray, lists: np.ndarray,
                     excluded: sp.csr_matrix, chunk: int = 4096) -> np.ndarray:
    """[m, E] catalogue codes (`EMPTY_SLOT` where fewer remain): each row's E =
    `titles.candidates` items most title-similar to one of its latest
    `titles.candidate_history` history items ([m, L] vocabulary indexes, latest last; the
    highest of their similarities, ties to the lower code), among the training rows' items
    (`titles.candidate_matrix`), leaving out its list's items (`lists` [m, n] codes) and its
    `excluded` ones ([m, num_items] CSR: the items it has seen). Only kept similarities count
    (`titles.neighbors` a history item), so no item without a word in common is added.
    `chunk` rows at a time (bounded memory)."""
    found = np.full((len(history), titles.candidates), EMPTY_SLOT, np.int64)
    latest = history[:, history.shape[1] - titles.candidate_history:]                # [m, L']
    matrix = titles.candidate_matrix
    for start in range(0, len(history), chunk):
        at = slice(start, start + chunk)
        similar = matrix[latest[at, 0]]                                              # [c, I]
        for slot in range(1, latest.shape[1]):
            similar = similar.maximum(matrix[latest[at, slot]])
        if not similar.nnz:                   # no row of the chunk has a similar title
            continue
        listed_row, listed_slot = np.nonzero(lists[at] != EMPTY_SLOT)
        taken = excluded[at] + sp.csr_matrix(                                        # [c, I]
            (np.ones(len(listed_row)), (listed_row, lists[at][listed_row, listed_slot])),
            shape=similar.shape)
        similar = similar.tocoo()
        free = np.asarray(taken[similar.row, similar.col]).ravel() == 0
        _, (row, col) = most_similar(similar.row[free], similar.col[free], similar.data[free],
                                     titles.candidates)
        found[start + row, np.arange(len(row)) - np.searchsorted(row, row)] = col
    return found


def with_title_candidates(signals: RankingSignals, data: ModelInputs, part: str,
                          lists: np.ndarray, excluded: sp.csr_matrix) -> np.ndarray:
    """[m, n + E] retrieval's candidate lists of `part` [m, n] followed by their title
    candidates (`title_candidates`; none for a user unknown before the part, who is served the
    popular list), as the ranking export's `candidates` signature adds them; `lists` as they
    are without title candidates."""
    titles = signals.titles
    if titles is None or not titles.candidates:
        return lists
    added = title_candidates(titles, data.examples[part]["history"], lists, excluded)
    added[~data.known_in(part)] = EMPTY_SLOT
    return np.concatenate([lists, added], axis=1)


def retrieval_scores(queries: np.ndarray, items: np.ndarray, codes: np.ndarray,
                     chunk: int = 8192) -> np.ndarray:
    """[m, n] float32 retrieval dot products of queries [m, e] with the items [num_items, e] at
    catalogue codes [m, n], a chunk of rows at a time (bounded memory). The same TF op as the
    export's, so that training, evaluation and serving see the same float32 values."""
    scores = np.empty(codes.shape, np.float32)
    for start in range(0, len(codes), chunk):
        rows = slice(start, start + chunk)
        scores[rows] = tf.einsum("me,mne->mn", queries[rows],                         # [m, n]
                                 tf.gather(items, codes[rows])).numpy()
    return scores


def list_examples(data: ModelInputs, signals: RankingSignals, part: str,
                  items: np.ndarray) -> dict[str, np.ndarray]:
    """The ranker's inputs for candidate lists `items` [m, n] of the rows of `part`: the model
    inputs of each row, "items" [m, n], "retrieval_scores", "transitions" and "cooccurrence"
    (each [m, n]) when the signals carry them, the `POPULARITY_SIGNALS` and `TITLE_SIGNAL` for
    held-out parts, and "rating" [m] of the item in slot 0 (zeros without ratings)."""
    examples = {k: v for k, v in data.examples[part].items() if k != "item"}
    examples["items"] = items
    if signals.has_retrieval:
        examples["retrieval_scores"] = retrieval_scores(
            signals.retrieval_queries[part], signals.retrieval_items, items)
    if signals.transitions is not None:
        examples["transitions"] = transition_features(signals.transitions, data, part, items)
    if signals.cooccurrence is not None:
        examples["cooccurrence"] = cooccurrence_features(signals.cooccurrence, data, part, items)
    if signals.popularity is not None and part != "train":
        examples.update(popularity_features(signals.popularity, data, part, items))
    if signals.titles is not None and part != "train":
        examples[TITLE_SIGNAL] = title_features(signals.titles, data, part, items)
    rating = data.interactions.rating
    rows = getattr(data.split, part)
    examples["rating"] = (np.zeros(len(rows), np.float32) if rating is None else rating[rows])
    return examples
