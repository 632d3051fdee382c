"""The training step is built from small parts, each chosen or made when ``train_step`` builds
the step (docs/architecture.md, "The step"): its settings checked then, one metrics mode, one
compiled step, the donated bound's caches and what the forward shows of the layers. The
pipeline step is built from the same parts; no device function branches on the metrics mode."""
import ast
import functools
import pathlib
import warnings

import pytest
import torch

import functional_pp as fpp
from functional_pp.models import llama
from functional_pp.step.compiled_step import CompiledStep
from functional_pp.step.known_finite import DonatedBound
from functional_pp.step.layering import LayerUse, NoLayerWarning
from functional_pp.step.metrics_modes import DeferredMetrics, PerStepMetrics
from functional_pp.step.device_step import PlainDeviceStep
from functional_pp.step.pipeline import PipelineSchedule, pipeline_step
from functional_pp.step.settings import StepSettings
from functional_pp.step.train import TrainStep

CFG = llama.Config(vocab=32, hidden=16, layers=2, heads=2, kv_heads=1, mlp=32, max_seq=16)
STEP = pathlib.Path(fpp.__file__).parent / "step"


def _step(**options) -> TrainStep:
    return fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(1e-2), **options)


def test_the_parts_are_made_when_the_step_is_built():
    per_step, deferred = _step(), _step(metrics="deferred", donate_state=True)
    for step in (per_step, deferred):
        assert isinstance(step, StepSettings)
        assert isinstance(step._compiled, CompiledStep) and isinstance(step._bound, DonatedBound)
        assert isinstance(step._layers, LayerUse)
    assert type(per_step._metrics) is PerStepMetrics and type(deferred._metrics) is DeferredMetrics
    # the bound is looked up once, for a donated step only
    assert per_step._bound.bound is None and deferred._bound.bound is not None
    # the pipeline's step is the same step, given the schedule's device function when built
    pipe = pipeline_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(1e-2), grad_accum=2)
    assert type(pipe) is TrainStep and type(pipe.device) is PipelineSchedule and pipe.device.step is pipe
    assert type(per_step.device) is PlainDeviceStep and per_step.device.step is per_step
    assert isinstance(pipe._compiled, CompiledStep) and isinstance(pipe._bound, DonatedBound)


def test_no_step_asks_which_kind_of_step_it_is():
    """The device function is a part chosen by the builder: no module asks a step for its class."""
    pkg = pathlib.Path(fpp.__file__).parent
    asks = [f"{f.relative_to(pkg)}:{n.lineno}" for f in sorted(pkg.rglob("*.py"))
            for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Call)
            and getattr(n.func, "id", None) == "isinstance" and len(n.args) == 2
            and "Pipeline" in ast.unparse(n.args[1])]
    assert not asks, f"isinstance checks on the pipeline's step: {asks}"


def test_the_update_strategy_is_chosen_when_the_step_is_built():
    """In place, in new buffers or written under a guard: one object per step, from donate_state,
    compile and what the optimizer declares (step/update.py); the redo of a held compiled step is
    its method, the eager form of a compiled step's the strategy ``trace`` runs."""
    from functional_pp.step.update import InNewBuffers, InPlace, WrittenUnderGuard
    assert type(_step()._update) is InNewBuffers
    assert type(_step(donate_state=True)._update) is InPlace          # adamw has an in-place step
    compiled = _step(donate_state=True, compile="aot_eager")          # (nothing compiled until a step runs)
    assert type(compiled._update) is WrittenUnderGuard and compiled._update.bound is compiled._bound.bound
    assert type(compiled._update.eager) is InPlace and type(compiled._update.without_donation) is InNewBuffers
    sgd = fpp.train_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.sgd(1e-2), donate_state=True)
    assert type(sgd._update) is InNewBuffers                           # no in-place step: new buffers
    pipe = pipeline_step(functools.partial(llama.loss, cfg=CFG), fpp.optim.adamw(1e-2), grad_accum=2,
                         donate_state=True, compile="aot_eager")      # stages compiled, the step eager
    assert type(pipe._update) is InPlace
    with pytest.raises(RuntimeError, match="never held"):
        _step()._update.redo(None, {}, {})


def test_the_pipeline_builder_sets_what_a_pipeline_runs_with_and_binding_changes_nothing_of_the_step():
    """pipeline_step computes the settings a pipeline runs with (step/pipeline.py
    ``pipeline_settings``: the stages' forwards compiled, not the step; no FSDP prefetch, no
    gradient buckets) before the step is made; its device function's ``bind`` only checks them."""
    import dataclasses
    loss = functools.partial(llama.loss, cfg=CFG)
    pipe = pipeline_step(loss, fpp.optim.adamw(1e-2), grad_accum=2, compile="aot_eager", bucket_mb=25,
                         fsdp_prefetch=True)
    assert pipe.compile is False and pipe.device.stage_compile == "aot_eager"
    assert pipe.policy.bucket_mb is None and pipe.policy.fsdp_prefetch is False
    settings = {f.name: getattr(pipe, f.name) for f in dataclasses.fields(StepSettings)}
    pipe.device.bind(pipe)
    assert {f.name: getattr(pipe, f.name) for f in dataclasses.fields(StepSettings)} == settings
    assert pipe.device.stage_compile == "aot_eager"
    for given in ({"compile": "aot_eager"}, {"policy": pipe.policy.replace(bucket_mb=25)}):
        with pytest.raises(ValueError, match="build it with pipeline_step"):
            TrainStep(loss, fpp.optim.adamw(1e-2), device=PipelineSchedule(), **given)


@pytest.mark.parametrize("options, words", [({"precision": "fp8"}, "precision 'fp8'"),
                                            ({"metrics": "lazy"}, "metrics 'lazy'"),
                                            ({"grad_accum": 0}, "grad_accum must be >= 1"),
                                            ({"throughput_tokens": "docs"}, "throughput_tokens 'docs': choose one of "
                                                                            "labels, rows")])
def test_a_bad_setting_is_refused_when_the_step_is_built(options, words):
    with pytest.raises(ValueError, match=words):
        _step(**options)


def test_the_tokens_metric_counts_labels_or_every_position_of_the_rows():
    """``throughput_tokens``: the non-ignored labels (tokens/s of trained tokens) or every position
    of the rows the step computes (EBFT's block-parallel rows), over accumulated micro-batches."""
    ids = torch.randint(0, CFG.vocab, (4, 9), generator=torch.Generator().manual_seed(0))
    labels = ids[:, 1:].clone()
    labels[:, :5] = -100
    batch = {"tokens": ids[:, :-1].contiguous(), "labels": labels}
    for counted, want in (("labels", 4 * 3), ("rows", 4 * 8)):
        step = _step(throughput_tokens=counted, grad_accum=2)
        state = step.init(fpp.init(llama.init, CFG, torch.float32, seed=0))
        _, m = step(state, batch)
        assert float(m["tokens"]) == want


def test_both_metrics_modes_train_alike():
    ids = torch.randint(0, CFG.vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    losses = []
    for mode in ("per_step", "deferred"):
        step = _step(metrics=mode)
        state = step.init(fpp.init(llama.init, CFG, torch.float32, seed=0))
        out = []
        for _ in range(3):
            state, m = step(state, batch)
            out.append(m)
        step.read()
        losses.append([float(m["loss"]) for m in out])
    assert losses[0] == losses[1]


def test_the_no_layer_warning_is_said_once_per_step():
    use = LayerUse()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        use._root_had_no_layers(stacklevel=1)
        use._root_had_no_layers(stacklevel=1)
    assert use.no_layers and [w.category for w in caught] == [NoLayerWarning]


def test_no_device_function_branches_on_the_metrics_mode():
    """The deferred mode's device-side choices (the skip selected on the device, a bad token id
    made a non-finite loss) are its wrapper's methods, not ``if self.metrics == ...`` branches."""
    for name in ("train.py", "pipeline.py"):
        tree = ast.parse((STEP / name).read_text())
        reads = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare)
                 and isinstance(n.left, ast.Attribute) and n.left.attr == "metrics"]
        assert not reads, f"step/{name} lines {reads} branch on the metrics mode: ask step._metrics instead"
