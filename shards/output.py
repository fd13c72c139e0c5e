"""Where converted shards go: the output store, checked before any work, and made ready.

A complete output (both splits' index.json) is refused unless asked to overwrite it. An
incomplete one loses its index.json files first, so a run killed while writing is never taken for
complete, and the temporary files a killed writer left in it (the splits' and the run's own
files, as large as what was being written) go. Then either everything is cleared (`resume=False`, or overwriting), or the parts
already written stay for the conversion to reuse (convert/run/conversion.py checks each part's marker).
"""

from __future__ import annotations

from shards.errors import ShardsError
from shards.index import INDEX_FILE
from shards.meta import SPLITS
from storage import StorageError, Store, open_store


def open_output(out: str) -> Store:
    """The store for `--out` (a local folder or s3://bucket/prefix), checked before any work."""
    try:
        store = open_store(out)
        store.check_writable()
    except StorageError as err:
        raise ShardsError(f"--out {out}: {err}") from None
    return store


def is_complete(store: Store) -> bool:
    return all(store.exists(f"{split}/{INDEX_FILE}") for split in SPLITS)


def refuse_complete(store: Store, overwrite: bool, again: str = "replace it") -> None:
    """ShardsError when `store` holds a complete conversion and `overwrite` is not given."""
    if not overwrite and is_complete(store):
        raise ShardsError(
            f"{store.url()} already holds a complete conversion (train/ and val/ index.json); "
            f"pass --overwrite to {again}, or choose another --out"
        )


def prepare_output(store: Store, *, overwrite: bool, resume: bool, files: tuple[str, ...] = ()) -> None:
    """Refuse a complete output (unless `overwrite`); remove both index.json files; then, when
    overwriting or not resuming, both splits and `files` (the run's other outputs) too."""
    refuse_complete(store, overwrite)
    for rel in ("", *SPLITS):
        store.remove_stale_temporaries(rel)
    for split in SPLITS:
        # An interrupted run may have finished one split; it is redone with the other.
        store.delete_tree(f"{split}/{INDEX_FILE}")
    if overwrite or not resume:
        for rel in (*SPLITS, *files):
            store.delete_tree(rel)
