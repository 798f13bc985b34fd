"""A trained mini-K3 (issue 25): K3's architecture at a few MB, trained in minutes on checkable synthetic tasks, so
the model-level evals measure accuracy (gates/evals/accuracy.py) and a subtly wrong kernel loses points.

- `config.py`: the mini config (every K3 layer kind in K3's proportions) and the training recipe;
- `data.py`: the task generators (recall, JSON from a schema, copying, known-distribution sampling, arithmetic;
  data version 2 adds recency and windowed counts, whose answers depend on how the KDA state forgets);
- `forward.py`: the differentiable training forward over the model's own layers and reference ops;
- `loop.py`: the training loop; `export.py`: MXFP4 quantization and the Hugging Face layout checkpoint.

`python -m model.kimi_k3.train --out DIR --seed S --minutes M --device cuda` trains and writes DIR; NOTES.md has
the size and time plan, `gpu_run.sh` the one-command H200 run.
"""
