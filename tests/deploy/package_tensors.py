#!/usr/bin/python3
"""Helpers of tests/deploy/package.sh: float32 tensors of a safetensors file, without packages.
  package_tensors.py raw FILE.safetensors NAME OUT.f32        write tensor NAME as raw float32; prints "T H"
  package_tensors.py check REF.safetensors NAME GOT TOL       GOT: a .safetensors (same NAME) or raw .f32;
                                                              fails unless ||got - ref|| / ||ref|| <= TOL
"""
import array
import json
import math
import struct
import sys


def tensor(path, name):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        if name not in header:
            sys.exit(f"package_tensors: {path} has no tensor '{name}'")
        t = header[name]
        if t["dtype"] != "F32":
            sys.exit(f"package_tensors: {path}:{name} is {t['dtype']}, not F32")
        begin, end = t["data_offsets"]
        f.seek(8 + n + begin)
        a = array.array("f")
        a.frombytes(f.read(end - begin))
    if sys.byteorder != "little":
        a.byteswap()
    return a, t["shape"]


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "raw":
        a, shape = tensor(sys.argv[2], sys.argv[3])
        with open(sys.argv[4], "wb") as f:
            a.tofile(f)
        print(" ".join(str(d) for d in shape))
        return
    if len(sys.argv) == 6 and sys.argv[1] == "check":
        ref, _ = tensor(sys.argv[2], sys.argv[3])
        if sys.argv[4].endswith(".safetensors"):
            got, _ = tensor(sys.argv[4], sys.argv[3])
        else:
            got = array.array("f")
            with open(sys.argv[4], "rb") as f:
                got.frombytes(f.read())
        tol = float(sys.argv[5])
        if len(got) != len(ref):
            sys.exit(f"package_tensors: {sys.argv[4]} has {len(got)} values, the reference {len(ref)}")
        num = math.sqrt(sum((g - r) ** 2 for g, r in zip(got, ref)))
        den = math.sqrt(sum(r * r for r in ref))
        rel = num / den if den else num
        print(f"relative error {rel:.3g} over {len(ref)} values (tolerance {tol:g})")
        if not rel <= tol:
            sys.exit(f"package_tensors: {sys.argv[4]} is off the reference by {rel:.3g} > {tol:g}")
        return
    sys.exit(__doc__.strip())


if __name__ == "__main__":
    main()
