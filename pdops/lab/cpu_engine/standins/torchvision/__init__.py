"""Import-only stand-in for torchvision (lab, real SGLang on CPU only; docs/lab.md).

torchvision's index builds are CUDA builds that cannot load beside the CPU torch. SGLang and
transformers import it for image models, which the lab never serves. Every submodule
(`torchvision.transforms.v2.functional`, ...) and every name in it exists, so that imports succeed;
calling any name raises. `InterpolationMode` is a real enum (used at import as a default value)."""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+pdops.lab.standin"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _NotHere:
    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: the pdops lab's torchvision is an import-only stand-in "
                           "(real SGLang on CPU serves text models only there)")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _NotHere(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (object,)


def _module_getattr(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        return _NotHere(f"{module_name}.{name}")
    return __getattr__


class _StandInSubmodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        return None


__getattr__ = _module_getattr(__name__)
sys.meta_path.append(_StandInSubmodules())
