"""Model weights in and out: one module per job. See docs/architecture.md.

  read.py          `read_weights(path)` / `load_model(path)`: any source below, our names, no code run
  build.py         a Transformer built from weights read: tying, names and shapes checked first
  safe_load.py     the pickle safety policy: weights-only unpickling, its allowlist, sharded folders
  run_folder.py    a run's checkpoint folder: the checkpoint resume would pick, checked against manifests
  composer_layout.py  our Composer checkpoint layout: wrapper levels stripped; `llm import`'s output
  keys.py          the names under which checkpoints record the model shape and the chat template
  hf.py            the Hugging Face Llama family (Llama, Mistral, Qwen2; Baichuan-7B's W_pack): names and
                   config.json both ways, what the model cannot compute refused; `llm import --from hf`
  hf_export.py     `llm export`: the files of a Hugging Face folder (weights, config, tokenizer, template)
  importing.py     what every `llm import` checks: the source's own statements against the recipe
  baby_llama2.py   baby-llama2-chinese / llama2.c `.pth` -> our tensors (rotary rows reordered)
  baichuan.py      Baichuan-7B folder -> our tensors (W_pack split through hf.py)

The package imports nothing itself (import the module you need), so `llm.weights.keys` stays
cheap for the callbacks that only need a key name.
"""
