"""The trained Stage 1 policy: a small decision tree stored as JSON.

The tree is trained by ``scripts/train_policy.py`` on data memscale makes
itself (a sweep of small models, budgets and strategies, with the peak of
each plan measured in a real training step) and shipped as
``memscale/policy/artifacts/strategy_tree.json``.  Inference is a handful
of comparisons in pure Python: no numpy, no scikit-learn, no network.

Artifact format ``memscale-strategy-tree/1``::

    {"format": "memscale-strategy-tree/1",
     "features": [...],            # names from memscale.policy.FEATURES
     "classes": [...],             # strategy names
     "tree": NODE,
     "training": {...}}            # provenance and held-out figures (free form)

    NODE = {"feature": NAME, "threshold": FLOAT, "le": NODE, "gt": NODE}
         | {"leaf": STRATEGY, "counts": {STRATEGY: INT, ...}}

A sample goes to ``le`` when ``features[NAME] <= threshold``.  Anything
that does not match (a missing or unreadable file, another format, an
unknown feature or strategy, a tree deeper than 32) raises
:class:`PolicyFallbackNeeded`, and Stage 1 uses the rule policy.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from pathlib import Path
from typing import Any

from ._types import FEATURES, STRATEGIES, PolicyFallbackNeeded, StrategyContext

__all__ = ["ARTIFACT_FORMAT", "DEFAULT_ARTIFACT", "TrainedPolicy", "load_trained_policy"]

ARTIFACT_FORMAT = "memscale-strategy-tree/1"
DEFAULT_ARTIFACT = Path(__file__).with_name("artifacts") / "strategy_tree.json"
MAX_DEPTH = 32
# Set to another tree's path to try it (experiments, tests).
ARTIFACT_ENV = "MEMSCALE_POLICY_ARTIFACT"


def _check_node(node: Any, features: list[str], depth: int, where: str) -> None:
    if depth > MAX_DEPTH:
        raise PolicyFallbackNeeded(f"{where}: the tree is deeper than {MAX_DEPTH}")
    if not isinstance(node, dict):
        raise PolicyFallbackNeeded(f"{where}: a node must be an object")
    if "leaf" in node:
        if node["leaf"] not in STRATEGIES:
            raise PolicyFallbackNeeded(f"{where}: unknown strategy {node['leaf']!r}")
        return
    feature, threshold = node.get("feature"), node.get("threshold")
    if feature not in features:
        raise PolicyFallbackNeeded(f"{where}: unknown feature {feature!r}")
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or not math.isfinite(threshold)
    ):
        raise PolicyFallbackNeeded(f"{where}: threshold must be a finite number")
    for side in ("le", "gt"):
        if side not in node:
            raise PolicyFallbackNeeded(f"{where}: a split needs '{side}'")
        _check_node(node[side], features, depth + 1, f"{where}.{side}")


class TrainedPolicy:
    """A strategy tree loaded from an artifact (see the module docstring)."""

    def __init__(self, artifact: dict[str, Any], *, digest: str = "") -> None:
        if not isinstance(artifact, dict):
            raise PolicyFallbackNeeded("the artifact must be a JSON object")
        if artifact.get("format") != ARTIFACT_FORMAT:
            raise PolicyFallbackNeeded(
                f"artifact format {artifact.get('format')!r} is not {ARTIFACT_FORMAT!r}"
            )
        features = artifact.get("features")
        if (
            not isinstance(features, list)
            or not features
            or any(f not in FEATURES for f in features)
        ):
            raise PolicyFallbackNeeded(
                f"artifact features must be a non-empty subset of {FEATURES}"
            )
        _check_node(artifact.get("tree"), features, 0, "tree")
        self.features = tuple(features)
        self.tree = artifact["tree"]
        self.training = artifact.get("training", {})
        self.digest = digest
        self.name = f"strategy-tree {digest[:12]}" if digest else "strategy-tree"

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> TrainedPolicy:
        """Load and validate an artifact (default: the shipped one)."""
        path = Path(path) if path is not None else DEFAULT_ARTIFACT
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise PolicyFallbackNeeded(
                f"the policy artifact {path} cannot be read ({exc.strerror or exc})"
            ) from exc
        try:
            artifact = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise PolicyFallbackNeeded(f"the policy artifact {path} is not JSON: {exc}") from exc
        except RecursionError:
            # JSON nested deeper than the interpreter's recursion limit: no
            # tree of MAX_DEPTH levels is, so it cannot be an artifact.
            raise PolicyFallbackNeeded(
                f"the policy artifact {path} is nested too deeply to be a "
                f"strategy tree (at most {MAX_DEPTH} levels)"
            ) from None
        return cls(artifact, digest=hashlib.sha256(raw).hexdigest())

    def predict(self, features: dict[str, float]) -> tuple[str, list[str]]:
        """The strategy for ``features`` and the path of tests that led to it."""
        node = self.tree
        path = []
        while "leaf" not in node:
            name = node["feature"]
            value = features[name]
            if value <= node["threshold"]:
                path.append(f"{name} {value:.3g} <= {node['threshold']:.3g}")
                node = node["le"]
            else:
                path.append(f"{name} {value:.3g} > {node['threshold']:.3g}")
                node = node["gt"]
        return node["leaf"], path

    def choose(self, context: StrategyContext) -> tuple[str, str]:
        """Return ``(strategy name, reason)`` for a profiled ``context``."""
        strategy, path = self.predict(context.features())
        return strategy, "tree: " + (", ".join(path) or "single leaf")


_cache: dict[tuple[str, int, int], TrainedPolicy] = {}
_cache_lock = threading.Lock()


def load_trained_policy(path: str | os.PathLike[str] | None = None) -> TrainedPolicy:
    """The trained policy from ``path``, else ``$MEMSCALE_POLICY_ARTIFACT``,
    else the shipped artifact; cached per file version.  Raises
    :class:`PolicyFallbackNeeded` when it cannot be used."""
    if path is None:
        path = os.environ.get(ARTIFACT_ENV) or DEFAULT_ARTIFACT
    resolved = Path(path)
    try:
        st = resolved.stat()
        key = (str(resolved.resolve()), st.st_mtime_ns, st.st_size)
    except ValueError as exc:  # a NUL byte in the path
        raise PolicyFallbackNeeded(
            f"the policy artifact path {str(path)!r} is not a valid path ({exc})"
        ) from exc
    except OSError as exc:
        raise PolicyFallbackNeeded(
            f"the policy artifact {resolved} cannot be read ({exc.strerror or exc})"
        ) from exc
    with _cache_lock:
        policy = _cache.get(key)
        if policy is None:
            policy = TrainedPolicy.load(resolved)
            _cache.clear()
            _cache[key] = policy
    return policy
