"""A GGUF with mixed per-tensor types, assembled from two exports of the same checkpoint.

llama-cpp-python's ``llama_model_quantize`` takes per-tensor types only as a C++ vector
(``tensor_types``), which ctypes cannot build, so the mix is made from two GGUFs that llama.cpp
quantized itself (``chattts-appliance engines export --precision q8_0`` and ``--precision q4_0``):
every tensor whose name matches one of ``--high`` (substrings, e.g. ``attn_v,ffn_down``) is copied
from ``--hi`` (its bytes as quantized there), every other from ``--lo``; the metadata is ``--lo``'s.
With ``--export-dir`` the result replaces ``gpt.gguf`` in a copy of ``--lo``'s export directory
(its manifest's sha256 updated), so that ``python -m bench precision`` and
``python -m bench step`` load it as that type (a helper of theirs, not a benchmark)::

    python -m bench.gguf_mix --hi E/llama/q8_0/gpt.gguf --lo E/llama/q4_0/gpt.gguf \\
        --high attn --export-dir MIX/llama/q4_0

Prints the bytes a decode step reads (every tensor but ``token_embd``) and each type's share.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path


def mix(hi: Path, lo: Path, high: list[str], out: Path) -> dict:
    """Write ``out`` (module docstring); returns {type name: bytes} of the step's tensors."""
    import gguf

    rh, rl = gguf.GGUFReader(str(hi)), gguf.GGUFReader(str(lo))
    by_hi = {t.name: t for t in rh.tensors}
    picked = [by_hi[t.name] if any(h in t.name for h in high) else t for t in rl.tensors]
    arch = rl.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    for f in rl.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vt, sub_type=sub)
    for t in picked:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in picked:
        w.write_tensor_data(t.data)
    w.close()
    share: dict[str, int] = {}
    for t in picked:
        if t.name != "token_embd.weight":
            share[t.tensor_type.name] = share.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return share


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hi", required=True, help="GGUF the matching tensors come from (e.g. q8_0)")
    ap.add_argument("--lo", required=True, help="GGUF every other tensor and the metadata come from (e.g. q4_0)")
    ap.add_argument("--high", required=True, help="comma-separated name substrings taken from --hi")
    ap.add_argument("--out", default=None, help="the GGUF to write (default: <export-dir>/gpt.gguf)")
    ap.add_argument("--export-dir", default=None, help="copy --lo's export directory here with the mix as gpt.gguf")
    args = ap.parse_args()
    lo = Path(args.lo)
    if args.export_dir:
        d = Path(args.export_dir)
        if d.exists():
            shutil.rmtree(d)
        shutil.copytree(lo.parent, d, ignore=shutil.ignore_patterns("gpt.gguf", "load-check-*"))
        out = d / "gpt.gguf"
    else:
        out = Path(args.out)
    share = mix(Path(args.hi), lo, [h for h in args.high.split(",") if h], out)
    if args.export_dir:
        m = json.loads((d / "manifest.json").read_text())
        h = hashlib.sha256(out.read_bytes()).hexdigest()
        files = m.get("files", {})
        if "gpt.gguf" in files:
            files["gpt.gguf"] = h if isinstance(files["gpt.gguf"], str) else {**files["gpt.gguf"], "sha256": h}
        m["notes_mix"] = f"tensors matching {args.high} from {args.hi}, the rest from {args.lo}"
        (d / "manifest.json").write_text(json.dumps(m, indent=1))
    total = sum(share.values())
    print(json.dumps({"out": str(out), "step_bytes": total, "by_type": share,
                      "share": {k: round(v / total, 3) for k, v in share.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
