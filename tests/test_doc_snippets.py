"""Every Python snippet in the README and docs/ runs.

A snippet that names something the reader is expected to have already (a
``model``, a ``batch``, an ``optimizer``, a Trainer's ``args``) gets it from
the page's context below, built as the page's prose describes it, at tiny
sizes. The few edits a snippet gets before it runs are listed in ``EDITS``,
each with its reason; anything else a snippet says is run as written, so a
renamed function, a changed signature or a removed Config field fails here.

Shell commands are not run here: the README's two commands are what CI runs
(``.ci/run``), and ``test_docs.py`` checks that every script and flag the
pages name exists.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TokenDataset, hf_training_args, tiny_gpt2, token_batch
from torch import nn

import memscale

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
SNIPPET = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets(page: Path) -> list[str]:
    return SNIPPET.findall(page.read_text())


def _gpt2(tmp_path: Path) -> dict[str, Any]:
    model = tiny_gpt2(dropout=0.0)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def make_batch(n: int) -> dict[str, torch.Tensor]:
        rows = torch.randint(0, 256, (n, 16), generator=torch.Generator().manual_seed(n))
        return {"input_ids": rows, "labels": rows}

    return {
        "torch": torch,
        "memscale": memscale,
        "model": model,
        "batch": {"input_ids": ids, "labels": ids},
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4),
        "make_batch": make_batch,
        "build_model": lambda: tiny_gpt2(dropout=0.0),
        "device": torch.device("cpu"),
    }


def _integrations(tmp_path: Path) -> dict[str, Any]:
    import lightning.pytorch as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                *[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)], nn.Linear(32, 1)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(2)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 32, generator=g), torch.randn(32, 1, generator=g)
    )
    args = hf_training_args(tmp_path / "out", max_steps=2, per_device_train_batch_size=2)
    return dict(
        _gpt2(tmp_path),
        args=args,
        data=TokenDataset(token_batch(batch=8, seq=16)),
        module=Module(),
        loader=torch.utils.data.DataLoader(data, batch_size=8),
    )


# page -> (the names its snippets may use, whether its snippets build on each
# other (run in one namespace) or are alternatives (each in a fresh one)).
CONTEXTS: dict[str, tuple[Callable[[Path], dict[str, Any]], bool]] = {
    "README.md": (lambda tmp: {}, True),  # the Quickstart, then the context manager on its names
    "docs/8bit-optimizer.md": (_gpt2, False),
    "docs/below-the-floor.md": (_gpt2, False),
    "docs/compile.md": (_gpt2, True),
    "docs/distributed.md": (_gpt2, False),
    "docs/integrations.md": (_integrations, False),
    "docs/observability.md": (lambda tmp: {}, False),
    "docs/prediction.md": (_gpt2, True),
}

# (page, text) -> replacement, each for a reason given beside it.
EDITS: dict[tuple[str, str], Callable[[Path], str]] = {
    # A run of a thousand steps shows nothing two do not.
    ("docs/integrations.md", "max_steps=1000"): lambda tmp: "max_steps=2",
    # max_batch_size confirms the largest batch that fits with a real step:
    # at 20 GiB that is a 17 GiB step on this tiny model.
    ("docs/prediction.md", "budget_bytes=20 << 30"): lambda tmp: "budget_bytes=64 << 20",
    # Inductor's code generation takes a minute here; aot_eager traces and
    # partitions the same graph (the checkpoint regions), without it.
    ("docs/compile.md", "torch.compile(model)"): lambda tmp: (
        'torch.compile(model, backend="aot_eager")'
    ),
    ("docs/compile.md", "torch.compile(build_model())"): lambda tmp: (
        'torch.compile(build_model(), backend="aot_eager")'
    ),
    # The placeholder path of the telemetry file.
    ("docs/observability.md", "/path/to/"): lambda tmp: f"{tmp}/",
}


def _pages_with_snippets() -> list[str]:
    return [str(p.relative_to(ROOT)) for p in PAGES if snippets(p)]


def test_every_page_with_snippets_has_a_context():
    assert sorted(CONTEXTS) == _pages_with_snippets()
    for page, text in EDITS:
        assert any(text in s for s in snippets(ROOT / page)), (page, text)


def _unwrap_all(namespace: dict[str, Any]) -> None:
    for value in list(namespace.values()):
        model = getattr(value, "model", value)
        if isinstance(model, nn.Module):
            for module in model.modules():
                if "_memscale_executor" in module.__dict__:
                    memscale.detach(module)


@pytest.fixture
def process_group(tmp_path):
    """A one-process gloo group, as a launcher would make for rank 0."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _run(page: str, tmp_path: Path, capsys: Any) -> int:
    factory, chained = CONTEXTS[page]
    found = snippets(ROOT / page)
    namespace: dict[str, Any] = factory(tmp_path)
    ran = 0
    for i, code in enumerate(found):
        for (where, text), replacement in EDITS.items():
            if where == page:
                code = code.replace(text, replacement(tmp_path))
        if not chained and i:
            _unwrap_all(namespace)
            namespace = factory(tmp_path)
        try:
            exec(compile(code, f"{page} snippet {i + 1}", "exec"), namespace)
        finally:
            if not chained:
                _unwrap_all(namespace)
        ran += 1
    _unwrap_all(namespace)
    return ran


# Pages whose snippets train for seconds (the README's quickstart, the
# predictor's batch-size search): the slow tier.
SLOW_PAGES = {"README.md", "docs/prediction.md"}


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(page, marks=pytest.mark.slow if page in SLOW_PAGES else ())
        for page in sorted(set(CONTEXTS) - {"docs/distributed.md"})
    ],
)
def test_snippets_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # Lightning's logs, the Trainer's output
    torch.manual_seed(0)
    assert _run(page, tmp_path, capsys) == len(snippets(ROOT / page)) > 0


def test_distributed_snippets_run(process_group, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    page = "docs/distributed.md"
    assert _run(page, tmp_path, capsys) == len(snippets(ROOT / page)) > 0
