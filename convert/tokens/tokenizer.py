"""SentencePiece tokenizer training, with Baichuan-7B's settings (loading one, for conversion and
training alike, is shards/tokenizer.py).

Training settings follow Baichuan-7B's tokenizer: BPE, byte fallback (no unknown characters,
every byte has a piece), every digit its own token, unk=0 / bos=1 / eos=2 and no pad, the
same special ids as the ChatGLM2 tokenizer baby-llama2-chinese uses. Text is taken as it is
(identity normalisation, whitespace kept): the cleaner already normalised it, and the model
must reproduce code and layout.

Any existing model (ChatGLM2's, Baichuan's) is used as it is (shards/tokenizer.py).
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Iterator

from convert.errors import ConvertError
from shards.tokenizer import Tokenizer, TokenizerInfo
from storage.local import atomic_write_bytes

# SentencePiece silently skips training sentences over max_sentence_length bytes; documents are
# cut into pieces of at most this many characters (<= 4 bytes each) so no text is skipped.
_TRAIN_PIECE_CHARS = 4000
_MAX_SENTENCE_BYTES = 4 * _TRAIN_PIECE_CHARS
_SEED = 20230615  # any fixed value: training must give the same model for the same input


def training_pieces(texts: Iterable[str]) -> Iterator[str]:
    """Lines of the documents, long lines cut, so SentencePiece skips none of the text."""
    for text in texts:
        for line in text.split("\n"):
            for start in range(0, len(line), _TRAIN_PIECE_CHARS):
                piece = line[start : start + _TRAIN_PIECE_CHARS]
                if piece.strip():
                    yield piece


def train_tokenizer(
    texts: Iterable[str],
    *,
    vocab_size: int,
    out: str,
    max_sentences: int = 10_000_000,
    character_coverage: float = 0.9995,
) -> TokenizerInfo:
    """Train a BPE model on `texts`, write it atomically to `out`; same input -> same bytes."""
    import sentencepiece as spm

    _check_training_options(vocab_size, out, max_sentences, character_coverage)
    spm.set_random_generator_seed(_SEED)
    writer = io.BytesIO()
    pieces = training_pieces(texts)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=pieces,
            model_writer=writer,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            split_digits=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            character_coverage=character_coverage,
            # The first max_sentences lines, in input order: a sample that does not move.
            input_sentence_size=max_sentences,
            shuffle_input_sentence=False,
            max_sentence_length=_MAX_SENTENCE_BYTES,
            max_sentencepiece_length=16,
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            # BPE training gains nothing from threads here, and the count is stored in the
            # model: a fixed value keeps the file's bytes (and sha256) machine-independent.
            num_threads=1,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise _training_error(err, vocab_size, character_coverage) from err
    model_bytes = writer.getvalue()
    atomic_write_bytes(out, model_bytes)
    return Tokenizer(out).info()


def _check_training_options(vocab_size: int, out: str, max_sentences: int, coverage: float) -> None:
    if vocab_size < 300:
        raise ConvertError(f"--vocab-size {vocab_size} is too small: byte fallback alone needs 259 pieces")
    if not 0.98 <= coverage <= 1.0:
        raise ConvertError(f"--character-coverage {coverage} must be in [0.98, 1] (SentencePiece's range)")
    if max_sentences < 1:
        raise ConvertError(f"--max-sentences {max_sentences} must be at least 1")
    if out.startswith("s3://"):
        raise ConvertError(f"--out {out}: write the tokenizer to a local path, then copy it to S3")


def _training_error(err: RuntimeError, vocab_size: int, coverage: float) -> ConvertError:
    message = str(err)
    needed = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", message)
    if needed:
        return ConvertError(
            f"--vocab-size {vocab_size} is too small for this corpus: keeping {coverage} of its "
            f"characters needs at least {needed.group(2)} pieces; raise --vocab-size or lower "
            "--character-coverage"
        )
    if "Vocabulary size is too high" in message or "vocab_size" in message:
        return ConvertError(
            f"--vocab-size {vocab_size} is too large for this corpus ({message.splitlines()[-1]}); "
            "lower it or add text"
        )
    if "No sentence" in message or "empty" in message.lower():
        return ConvertError("no text to train the tokenizer on; check the inputs, --format and --field")
    return ConvertError(f"SentencePiece training failed: {message.splitlines()[-1] if message else err}")
