"""A lean install (``pip install .``: pyproject's ``dependencies`` only) imports and trains, and
an optional feature then names its extra. Proven in a fresh interpreter whose imports of every
extra's packages find nothing (each meta-path finder is wrapped), so this machine's full install does not
hide a stray import."""
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: each distribution an extra brings -> the module it is imported as (a new extra must be added here)
MODULE_OF = {"pytest": "pytest", "hypothesis": "hypothesis", "transformers": "transformers",
             "pytest-timeout": "pytest_timeout", "pytest-xdist": "xdist", "tokenizers": "tokenizers",
             "jinja2": "jinja2", "tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab", "jax": "jax",
             "bitsandbytes": "bitsandbytes", "torchao": "torchao", "peft": "peft", "trl": "trl", "mistral-common": "mistral_common",
             "matplotlib": "matplotlib", "pyarrow": "pyarrow", "datasets": "datasets",
             "opentelemetry-sdk": "opentelemetry.sdk", "opentelemetry-exporter-prometheus": "opentelemetry.exporter.prometheus"}
TRAINING_NEEDS = {"torch", "optree", "numpy", "safetensors", "pyyaml"}


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_default_dependencies_are_what_training_needs():
    project = _project()
    assert {_name(r) for r in project["dependencies"]} == TRAINING_NEEDS
    extras = {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    assert extras <= set(MODULE_OF), f"add the module name of {extras - set(MODULE_OF)} to MODULE_OF"


SCRIPT = textwrap.dedent("""
    import importlib.abc, json, sys
    BLOCKED = set(sys.argv[1].split(","))
    refused = []

    class Lean(importlib.abc.MetaPathFinder):
        # wraps a finder: a blocked package is not found, as where it is not installed
        def __init__(self, inner):
            self.inner = inner

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                refused.append(name)
                return None
            return self.inner.find_spec(name, path, target)

        def invalidate_caches(self):
            getattr(self.inner, "invalidate_caches", lambda: None)()

    sys.meta_path[:] = [Lean(f) for f in sys.meta_path]
    import functional_pp as fpp
    from functional_pp import cli
    out, config = sys.argv[2], sys.argv[3]
    rc = cli.main(["train", config, "--output", out])
    errors = {}
    from functional_pp.data.tokenizer import HFTokenizer
    try:
        HFTokenizer(config)
    except ImportError as exc:
        errors["tokenizer"] = str(exc)
    rc_tb = cli.main(["train", config, "--output", out + "-tb", "--set", "use_tensorboard=true"])
    print(json.dumps({"rc": rc, "rc_tb": rc_tb, "errors": errors, "refused": sorted(set(refused)),
                      "loaded": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)}))
""")


def test_a_lean_install_trains_and_names_the_extra_of_a_missing_feature(tmp_path):
    blocked = sorted(set(MODULE_OF.values()) - {"pytest"})
    config = tmp_path / "tiny.yaml"
    config.write_text("model: tiny\nmicro_batch_size: 2\nsequence_len: 16\nmax_steps: 2\n"
                      "data: {max_bytes: 20000}\nlogging: {log_every: 1}\n")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(blocked), str(out), str(config)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0 and result["loaded"] == []
    assert "matplotlib" in result["refused"]                   # the run tried the plot, and went on
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not (out / "loss.png").exists()
    assert result["errors"]["tokenizer"].startswith("reading a Hugging Face tokenizer needs the 'tokenizers' "
                                                    "package, which is not installed: pip install "
                                                    "'functional_pp[hf]'")
    assert result["rc_tb"] == 2                                # a config error
    assert "use_tensorboard needs the 'tensorboard' package, which is not installed: pip install " \
           "'functional_pp[tensorboard]'" in proc.stdout + proc.stderr
