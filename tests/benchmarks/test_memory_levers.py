"""benchmarks/memory_levers.py: each lever predicted and measured on a tiny model on the CPU;
the levers change memory, never the losses, and the table names every lever run."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import memory_levers  # noqa: E402


def test_levers_keep_the_losses_and_offload_moves_the_state_to_the_host():
    out = memory_levers.run(memory_levers.parse_args(
        ["--smoke", "--measure", "--steps", "2", "--levers", "none,selective,selective_alternate,offload_params,activation_offloading"]))
    rows = out["rows"]
    assert rows["none"]["losses"] == rows["selective"]["losses"] == rows["offload_params"]["losses"]
    assert rows["selective_alternate"]["losses"] == rows["none"]["losses"]
    assert rows["offload_params"]["peak_bytes"] < rows["none"]["peak_bytes"] < rows["offload_params"]["host_bytes"] * 2
    assert rows["none"]["host_bytes"] == 0 < rows["activation_offloading"]["host_bytes"]
    assert "losses" not in rows["activation_offloading"]        # CUDA only: predicted, not run
    text = memory_levers.table(out)
    assert all(f"`{lever}`" in text for lever in rows) and "measured step" in text


def test_unknown_lever_is_refused_naming_the_choices():
    with pytest.raises(SystemExit, match="unknown lever 'offload'.*offload_params"):
        memory_levers.run(memory_levers.parse_args(["--smoke", "--levers", "offload"]))


def test_write_replaces_only_the_marked_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{memory_levers.BEGIN}\nold\n{memory_levers.END}\nafter\n")
    memory_levers.write_readme("| new |", str(readme))
    assert readme.read_text() == f"before\n{memory_levers.BEGIN}\n| new |\n{memory_levers.END}\nafter\n"
