"""A stand-in for Hugging Face's output type, shared by the tests and the workers (no
transformers install, no hub download)."""

from collections import OrderedDict
from typing import Any


class ModelOutputLike(OrderedDict):  # type: ignore[type-arg]
    """Like transformers' ModelOutput: an ordered mapping whose keys are also attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as error:
            raise AttributeError(name) from error
