"""Scenario code that the tests and the benchmarks both run: neither imports the other, both import this.

`scenarios.resume`: tiny token shards, a tiny recipe, real `train.py` processes with a recorder
(`scenarios/resume_driver.py`), and the checks that decide "resumed bit-identically".
`scenarios.lm_eval_compare`: our multiple-choice scores beside lm-eval's on the same export.
`scenarios.sft_demo` and `scenarios.bigram`: the two demos' closing figures (held-out accuracy by
review length; the bigram baseline beside the model's eval loss), run by `make demo-sft` / `make demo`.
`scenarios.byte_bpe`: a Hugging Face tokenizer.json made on the spot (the tests', `make bench-tokenizer`'s).
"""
