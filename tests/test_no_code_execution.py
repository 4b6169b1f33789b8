"""No code execution: the library never runs code found in a file.

Two guards. A scan of the source tree (``src/``, parsed with ``ast`` so that comments, strings
and methods such as ``model.eval()`` do not count) keeps it free of unpickling, ``torch.load``
without ``weights_only=True``, ``eval``/``exec``/``compile``, ``marshal``, unsafe YAML loading,
imports by computed name and ``numpy.load(allow_pickle=True)``. And behavioural tests: files
whose metadata, attributes, tensor data or class tag carry a pickle payload or Python code that
would create a marker file if run are loaded as plain data or refused with
``T2NErrorStorage``; the marker never appears and no module named by a file is imported.
"""

from __future__ import annotations

import ast
import base64
import json
import pickle
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from stress.figures import record

from torch_to_nnef.exceptions import T2NErrorStorage
from torch_to_nnef.tensor import storage
from torch_to_nnef.tensor.offload import OffloadedTensor
from torch_to_nnef.tensor.quant import fp_to_tract_q4_0_with_min_max_calibration
from torch_to_nnef.tensor.residency import TensorResidencyPool

SOURCE_ROOT = Path(__file__).resolve().parents[1] / "src"

# ---------------------------------------------------------------------------------------------
# The source scan
# ---------------------------------------------------------------------------------------------
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "__import__", "execfile"}
FORBIDDEN_CALLS = {
    "pickle.load",
    "pickle.loads",
    "pickle.Unpickler",
    "_pickle.load",
    "_pickle.loads",
    "marshal.load",
    "marshal.loads",
    "dill.load",
    "dill.loads",
    "cloudpickle.load",
    "cloudpickle.loads",
    "joblib.load",
    "shelve.open",
    "yaml.unsafe_load",
    "yaml.full_load",
    "yaml.load_all",
    "importlib.import_module",
    "builtins.eval",
    "builtins.exec",
    "builtins.compile",
    "builtins.__import__",
    "runpy.run_path",
    "runpy.run_module",
    "torch.serialization._load",
    "copyreg.constructor",
}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader"}


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attribute accesses on a name, else ``None``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def violations(source: str, filename: str) -> Iterator[str]:
    """Every construct of ``source`` that could run code read from a file."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}  # local name -> module or object it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = alias.name
                if alias.name.split(".")[0] in FORBIDDEN_MODULES:
                    yield f"{filename}:{node.lineno}: import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                yield f"{filename}:{node.lineno}: from {node.module} import ..."
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        if name is None:
            continue
        head, _, rest = name.partition(".")
        full = f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head, head)
        where = f"{filename}:{node.lineno}: {name}(...)"
        builtin = isinstance(node.func, ast.Name) and full in FORBIDDEN_BUILTINS
        if builtin or full in FORBIDDEN_CALLS:
            yield where
        elif full == "torch.load" and not _is_true(_keyword(node, "weights_only")):
            yield f"{where} without weights_only=True"
        elif full == "yaml.load":
            loader = _keyword(node, "Loader")
            if loader is None and len(node.args) > 1:
                loader = node.args[1]
            loader_name = dotted(loader) if loader is not None else None
            if loader_name is None or loader_name.split(".")[-1] not in SAFE_YAML_LOADERS:
                yield f"{where} without a safe Loader"
        elif full in ("numpy.load", "np.load") and _is_true(_keyword(node, "allow_pickle")):
            yield f"{where} with allow_pickle=True"
        elif name.endswith(".find_class") or name.endswith("__reduce__"):
            yield f"{where}: reduce-based loading"


def test_the_source_tree_never_runs_code_from_files() -> None:
    files = sorted(SOURCE_ROOT.rglob("*.py"))
    assert len(files) > 20, f"no sources found under {SOURCE_ROOT}"
    found = [v for path in files for v in violations(path.read_text(), str(path))]
    assert found == [], "\n".join(found)
    record("no_code_execution_scan", source_files=len(files))


PLANTED = {
    "pickle-loads": "import pickle\npickle.loads(data)\n",
    "pickle-load-alias": "from pickle import load as l\nl(f)\n",
    "pickle-module-alias": "import pickle as p\np.Unpickler(f).load()\n",
    "torch-load": "import torch\ntorch.load(path)\n",
    "torch-load-false": "import torch\ntorch.load(path, weights_only=False)\n",
    "torch-load-alias": "from torch import load\nload(path)\n",
    "eval": "eval(text)\n",
    "exec": "exec(code)\n",
    "compile": "compile(src, 'f', 'exec')\n",
    "dunder-import": "__import__(name)\n",
    "marshal": "import marshal\nmarshal.loads(b)\n",
    "yaml-load": "import yaml\nyaml.load(text)\n",
    "yaml-unsafe-loader": "import yaml\nyaml.load(text, Loader=yaml.UnsafeLoader)\n",
    "yaml-full": "import yaml\nyaml.full_load(text)\n",
    "import-module": "import importlib\nimportlib.import_module(tag)\n",
    "numpy-pickle": "import numpy as np\nnp.load(path, allow_pickle=True)\n",
    "find-class": "unpickler.find_class(module, name)\n",
    "builtins-eval": "import builtins\nbuiltins.eval(text)\n",
}
ALLOWED = {
    "model-eval": "model.eval()\n",
    "regex-compile": "import re\nre.compile('x')\n",
    "torch-load-safe": "import torch\ntorch.load(path, weights_only=True)\n",
    "yaml-safe": "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)\nyaml.safe_load(text)\n",
    "strings": "'''pickle.loads(data) and eval(x)'''\n# torch.load(path)\n",
    "refuse-pickling": "class T:\n    def __reduce_ex__(self, p):\n        raise TypeError\n",
}


@pytest.mark.parametrize("case", list(PLANTED))
def test_the_scan_catches_planted_code(case: str) -> None:
    assert list(violations(PLANTED[case], case)), f"the scan missed {PLANTED[case]!r}"


@pytest.mark.parametrize("case", list(ALLOWED))
def test_the_scan_accepts_harmless_code(case: str) -> None:
    assert list(violations(ALLOWED[case], case)) == []


# ---------------------------------------------------------------------------------------------
# Hostile files
# ---------------------------------------------------------------------------------------------
class Bomb:
    """Unpickling this creates the marker file: proof that code from a file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "code-ran"
    yield path
    assert not path.exists(), "code from a file was executed"


def code_strings(marker: Path) -> list[str]:
    bomb = pickle.dumps(Bomb(marker))
    return [
        base64.b64encode(bomb).decode(),
        bomb.decode("latin-1"),
        f"__import__('pathlib').Path({str(marker)!r}).touch()",
        f"eval(\"__import__('os').system('touch {marker}')\")",
        "!!python/object/apply:os.system ['touch " + str(marker) + "']",
    ]


def test_metadata_carrying_pickles_and_code_loads_as_data(tmp_path: Path, marker: Path) -> None:
    strings = code_strings(marker)
    metadata = {f"k{i}": text for i, text in enumerate(strings)}
    metadata["format"] = "pt"
    path = tmp_path / "hostile.safetensors"
    storage.write_payload(path, {"tensor": torch.arange(4.0)}, metadata)
    layout = storage.read_layout(path)
    assert dict(layout.metadata) == metadata  # the strings, untouched
    assert torch.equal(storage.read_payload(layout)["tensor"], torch.arange(4.0))
    tensor = OffloadedTensor.from_safetensors(path, "tensor")
    assert torch.equal(tensor.reload(), torch.arange(4.0))
    with TensorResidencyPool() as pool:
        assert torch.equal(pool.resolve(tensor), torch.arange(4.0))
    # The same strings as the class tag of an opaque payload: refused, never imported.
    for text in strings:
        forged = {"t2n.class": text, "t2n.attributes": json.dumps({"code": text})}
        with pytest.raises(T2NErrorStorage, match="unknown offload class tag"):
            storage.decode_opaque({"tensor": torch.zeros(1)}, forged)


def test_tensor_data_holding_a_pickle_stays_bytes(tmp_path: Path, marker: Path) -> None:
    bomb = pickle.dumps(Bomb(marker))
    data = torch.frombuffer(bytearray(bomb), dtype=torch.uint8)
    path = tmp_path / "bytes.safetensors"
    storage.write_payload(path, {"tensor": data})
    tensor = OffloadedTensor.from_safetensors(path, "tensor")
    assert bytes(tensor.reload().numpy().tobytes()) == bomb


@pytest.mark.parametrize("kind", ["raw-pickle", "torch-save", "pickle-after-header"])
def test_pickle_files_named_like_payloads_are_refused(
    tmp_path: Path, marker: Path, kind: str
) -> None:
    path = tmp_path / "model.safetensors"
    if kind == "raw-pickle":
        path.write_bytes(pickle.dumps({"tensor": Bomb(marker)}))
    elif kind == "torch-save":
        torch.save({"tensor": torch.zeros(2), "x": Bomb(marker)}, path)
    else:  # a valid-looking length prefix and header, then a pickle where data should be
        header = json.dumps({"tensor": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})
        path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + pickle.dumps(1))
    with pytest.raises(T2NErrorStorage, match=str(path)):
        OffloadedTensor.from_safetensors(path, "tensor")
    with pytest.raises(T2NErrorStorage, match=str(path)):
        storage.read_layout(path)


EVIL_MODULE = """
from pathlib import Path
Path({marker!r}).touch()

class Evil:
    @classmethod
    def from_offload_state(cls, state, target_device=None):
        Path({marker!r}).touch()
"""


QUANTIZED = fp_to_tract_q4_0_with_min_max_calibration(
    torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
)


def forged_opaque_file(directory: Path, tag: str, attributes: dict[str, Any]) -> Path:
    """A payload of a real Q4_0 tensor whose class tag and attributes were rewritten."""
    tensors, metadata = storage.encode_opaque(QUANTIZED)
    metadata = {"t2n.class": tag, "t2n.attributes": json.dumps(attributes)}
    path = storage.payload_path(directory, "q", "forged")
    storage.write_payload(path, tensors, metadata)
    return path


def test_a_forged_class_tag_never_imports_or_runs_anything(
    tmp_path: Path, marker: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A module on sys.path whose import (or whose class) would create the marker.
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "t2n_evil_module.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(modules))
    tags = [
        "t2n_evil_module.Evil",
        "os.system",
        "builtins.eval",
        "subprocess.Popen",
        "pickle.loads",
        "torch_to_nnef.tensor.offload.OffloadedTensor",
        "torch_to_nnef.tensor.quant.qtract.QTensorTractScaleOnly",  # module path, not its tag
        "",
    ]
    refused = 0
    for tag in tags:
        offload_dir = tmp_path / f"tag{refused}"
        offload_dir.mkdir()
        path = forged_opaque_file(offload_dir, tag, {"code": "__import__('os')"})
        layout = storage.read_layout(path)
        assert storage.is_opaque_payload(layout.metadata)
        with pytest.raises(T2NErrorStorage, match="unknown offload class tag"):
            storage.decode_opaque(storage.read_payload(layout), layout.metadata)
        with pytest.raises(T2NErrorStorage, match="unknown offload class tag"):
            OffloadedTensor(None, "cpu", offload_dir, "q", storage_id="forged")
        refused += 1
    assert "t2n_evil_module" not in sys.modules
    record("no_code_execution_files", faults=refused + 2 * len(code_strings(marker)))


def test_code_in_the_attributes_of_a_real_class_is_data(tmp_path: Path, marker: Path) -> None:
    _, metadata = storage.encode_opaque(QUANTIZED)
    attributes = json.loads(metadata["t2n.attributes"])
    tag = metadata["t2n.class"]
    for text in code_strings(marker):
        # A string field may hold any text: it is kept as such.
        named = forged_opaque_file(tmp_path, tag, {**attributes, "nnef_name": text})
        value = OffloadedTensor.from_safetensors(named, "u8_blob")  # the raw codes only
        assert value.reload().dtype == torch.uint8
        layout = storage.read_layout(named)
        decoded = storage.decode_opaque(storage.read_payload(layout), layout.metadata)
        assert isinstance(decoded, type(QUANTIZED)) and decoded.nnef_name == text
        assert torch.equal(decoded.decompress(), QUANTIZED.decompress())
        named.unlink()
        # A field that selects behaviour refuses code instead of running it.
        for field in ("dequant_to_dtype", "format", "shape"):
            forged = forged_opaque_file(tmp_path, tag, {**attributes, field: text})
            layout = storage.read_layout(forged)
            with pytest.raises(T2NErrorStorage, match=field):
                storage.decode_opaque(storage.read_payload(layout), layout.metadata)
            forged.unlink()


@pytest.mark.timeout(30)
def test_a_forged_tag_reaches_pool_callers_as_a_storage_error(tmp_path: Path, marker: Path) -> None:
    tensor = OffloadedTensor.from_original_tensor(QUANTIZED, "q", offload_dir=tmp_path)
    path = tensor.offload_path
    tensors = storage.read_payload(storage.read_layout(path))
    forged = {"t2n.class": "t2n_evil_module.Evil", "t2n.attributes": "{}"}
    storage.write_payload(path, tensors, forged)  # rewritten behind the tensor's back
    with TensorResidencyPool() as pool:
        with pytest.raises(T2NErrorStorage):
            pool.resolve(tensor)
        assert pool.stats().load_errors == 1
    with pytest.raises(T2NErrorStorage):
        tensor.reload()
