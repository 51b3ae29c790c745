"""eval-smoke (smoke.py): lm-evaluation-harness on octavo serve and on its own hf backend, same GGUF, one accuracy.

Runs in lm-eval's venv (requirements.txt; `make eval-smoke`) on the local tasks in tasks/."""
