"""Which model a name builds: ``create_model("gpt", **kwargs)`` looks up the registry;
``create_model("pkg.mod:fn", **kwargs)`` imports ``fn`` and calls it with the same keyword
arguments (the model config's fields); ``create_model("hf:<dir>", **kwargs)`` builds a Hugging
Face causal LM (``trainer.models.hf``), as it does for an entry point that returns one. An
entry point that raises is one line naming it (``ModelError``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

from trainer.errors import first_line
from trainer.models.gpt import GPT, GPTConfig
from trainer.models.hf import PREFIX, HFCausalLM, build_hf_model, is_hf_causal_lm


def gpt(**kwargs: object) -> GPT:
    return GPT(GPTConfig(**kwargs))  # type: ignore[arg-type]


MODEL_REGISTRY: dict[str, Callable[..., nn.Module]] = {"gpt": gpt}


class ModelError(Exception):
    """A user's model entry point raised while building the model: one line naming the entry
    point and its error, wherever it was built (the driver's planner, or a worker, whose line
    adds the rank). Exit 2 for an error the user fixes (a ValueError, a missing file), else 1."""

    one_line = True

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self) -> tuple[type[ModelError], tuple[str, int]]:
        return type(self), (str(self), self.exit_code)  # Ray sends a worker's error pickled

    @classmethod
    def raised_by(cls, name: str, err: Exception) -> ModelError:
        message = first_line(err, "")
        detail = f"{type(err).__name__}: {message}" if message else type(err).__name__
        return cls(f"model.name {name!r}: {detail}",
                   2 if isinstance(err, ValueError | FileNotFoundError) else 1)


def create_model(name: str, load_weights: bool = True, **kwargs: object) -> nn.Module:
    """Build a registered model or call a ``module:function`` entry point with ``kwargs``
    (``load_weights=False``: an ``hf:`` model without its weights, read later per rank).

    Raises ValueError for a name that does not resolve, and ``ModelError`` for an entry point
    that raised."""
    if name.startswith(PREFIX):
        return build_hf_model(name.removeprefix(PREFIX), load_weights=load_weights,
                              **kwargs)  # type: ignore[arg-type]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"model.name {name!r}: cannot import entry point ({err})") from err
    elif name in MODEL_REGISTRY:
        factory = MODEL_REGISTRY[name]
    else:
        valid = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"model.name {name!r} is not registered (registered: {valid}; "
                         "or give module:function)")
    if ":" in name:
        try:
            model = factory(**kwargs)
        except Exception as err:
            raise ModelError.raised_by(name, err) from err
    else:
        model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model.name {name!r} returned {type(model).__name__}, not an nn.Module")
    return HFCausalLM(model) if is_hf_causal_lm(model) else model
