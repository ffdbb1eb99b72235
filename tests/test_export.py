"""``python -m lit_gmc export``: a checkpoint, also one written after a resume, becomes a loadable HF folder."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from run_helpers import component, fit, write_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_gmc.export import export_checkpoint

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False


@pytest.fixture(scope="module")
def resumed_checkpoint(tmp_path_factory):
    """A tiny run checkpointed at step 2, resumed from there to step 4: its last.ckpt holds theta_4."""
    root = tmp_path_factory.mktemp("export")
    config = write_config(root, "run", total=2, every=2, schedule=component("FixedDelay", delay=1))
    fit(config)
    fit(config, "--trainer.max_steps", "4", "--ckpt_path", "last")
    path = root / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(path, weights_only=True)["global_step"] == 4
    return path


def test_export_after_a_resume_loads_with_transformers(resumed_checkpoint, tmp_path):
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "lit_gmc", "export", "--ckpt_path", str(resumed_checkpoint),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    state = torch.load(resumed_checkpoint, weights_only=True)["state_dict"]
    exported = model.state_dict()
    actor = {k.removeprefix("actor."): v for k, v in state.items() if k.startswith("actor.")}
    assert set(actor) <= set(exported)
    for name, value in actor.items():
        assert torch.equal(exported[name], value), name  # the weights after the resumed run's last update
    ids = tokenizer("12+30=", add_special_tokens=False, return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "12+30="
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()


def test_export_refuses_what_it_cannot_do(resumed_checkpoint, tmp_path):
    existing = tmp_path / "taken"
    existing.mkdir()
    with pytest.raises(FileExistsError, match="exports never overwrite"):
        export_checkpoint(resumed_checkpoint, existing)
    other = tmp_path / "other.ckpt"
    torch.save({"state_dict": {"layer.weight": torch.zeros(1)}}, other)
    done = subprocess.run([sys.executable, "-m", "lit_gmc", "export", "--ckpt_path", str(other), "--out",
                           str(tmp_path / "x")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2 and "not a lit_gmc training checkpoint" in done.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")
def test_export_loads_in_vllm_and_samples_like_transformers(resumed_checkpoint, tmp_path):
    from lit_gmc.data.engines import HFEngine, SamplingParams
    from lit_gmc.data.tasks import Prompt
    from lit_gmc.data.vllm_engine import VLLMEngine

    out = export_checkpoint(resumed_checkpoint, tmp_path / "hf")
    prompts = [Prompt(i, f"{i}+{i + 3}=", "") for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    engine = VLLMEngine()
    engine.start(str(out))
    try:
        from_vllm = [g.response_ids[0][g.response_mask[0]].tolist() for g in engine.generate(prompts, 1, greedy)]
    finally:
        engine.close()
    reference = HFEngine()
    reference.start(str(out))
    from_hf = [g.response_ids[0][g.response_mask[0]].tolist() for g in reference.generate(prompts, 1, greedy)]
    assert from_vllm == from_hf
