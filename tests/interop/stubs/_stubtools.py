"""Modules where every attribute exists: what SGLang's imports of triton and torchvision need."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class Anything:
    """Any attribute, call, subscript or base class; as a decorator, returns what it wraps."""

    def __init__(self, name: str = "stub") -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return Anything(self._name)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Anything(f"{self._name}.{name}")

    def __getitem__(self, key: Any) -> Any:
        return Anything(self._name)

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)

    def __repr__(self) -> str:
        return f"<stub {self._name}>"


class _AnyClass(type):
    """A stand-in class: its class attributes are stand-ins too."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Anything(f"{cls.__name__}.{name}")


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():  # a class: isinstance() and subclassing must work
            cls = _AnyClass(name, (), {"__init__": lambda self, *a, **k: None})
            setattr(self, name, cls)
            return cls
        return Anything(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every submodule of ``root`` is a stand-in module."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install(root: str) -> None:
    """Make the package ``root`` (already being imported) and its submodules stand-ins."""
    sys.modules[root].__class__ = _Module
    sys.meta_path.insert(0, _Finder(root))
