#!/usr/bin/env python3
"""campaign_helper.py - byte and JSON damage for scripts/hardening-campaign.sh (issue 32).

  flip FILE OFF BIT          xor one bit
  trunc FILE LEN             truncate to LEN bytes
  zero FILE OFF LEN          zero a range
  append FILE N              append N bytes 0xA5
  jsonedit FILE PATH OP      PATH a.b.c (list index as number); OP del|inc|neg|zero|huge|str|null|list|obj
  jsonpaths FILE             every leaf path, one a line
  stedit FILE OP ARG         safetensors: hlen=N | rename=NAME | dtype=NAME:DT | shape=NAME | offs=NAME
  offsets SEED N SIZE        N offsets in [0, SIZE): half in the first 4096 bytes
"""
import json
import random
import struct
import sys


def rd(p):
    with open(p, "rb") as f:
        return f.read()


def wr(p, b):
    with open(p, "wb") as f:
        f.write(b)


def leaves(o, pre=""):
    if isinstance(o, dict):
        for k, v in o.items():
            if pre == "checksums":
                yield f"{pre}.{k}"
                continue
            yield from leaves(v, f"{pre}{k}" if not pre else f"{pre}.{k}")
            if isinstance(v, (dict, list)):
                yield (f"{pre}.{k}" if pre else k)
    elif isinstance(o, list):
        for i, v in enumerate(o):
            yield from leaves(v, f"{pre}.{i}")
    else:
        yield pre


def walk(o, path):
    """The container and key of PATH; dict keys may hold dots ("checksums.target.name")."""
    parts = path.split(".")
    i = 0
    while True:
        if isinstance(o, list):
            k, j = int(parts[i]), i + 1
        else:
            j = i + 1
            while ".".join(parts[i:j]) not in o and j < len(parts):
                j += 1
            k = ".".join(parts[i:j])
        if j == len(parts):
            return o, k
        o, i = o[k], j


def mutate(v, op):
    if op == "inc":
        if isinstance(v, bool):
            return not v
        if isinstance(v, (int, float)):
            return v + 1
        if isinstance(v, str):
            return v + "x"
        return v
    return {"neg": -1, "zero": 0, "huge": 1e30, "str": "abc", "null": None, "list": [1],
            "obj": {}, "big": 18446744073709551617}.get(op, v)


def main():
    a = sys.argv[1:]
    op = a[0]
    if op == "flip":
        b = bytearray(rd(a[1]))
        off = int(a[2]) % max(1, len(b))
        if b:
            b[off] ^= 1 << int(a[3])
        wr(a[1], b)
    elif op == "trunc":
        with open(a[1], "r+b") as f:
            f.truncate(int(a[2]))
    elif op == "zero":
        b = bytearray(rd(a[1]))
        off, n = int(a[2]), int(a[3])
        off = min(off, len(b))
        n = min(n, len(b) - off)
        b[off:off + n] = b"\0" * n
        wr(a[1], b)
    elif op == "append":
        with open(a[1], "ab") as f:
            f.write(b"\xa5" * int(a[2]))
    elif op == "jsonpaths":
        for p in leaves(json.loads(rd(a[1]))):
            print(p)
    elif op == "jsonedit":
        m = json.loads(rd(a[1]))
        o, k = walk(m, a[2])
        if a[3] == "del":
            del o[k]
        else:
            o[k] = mutate(o[k], a[3])
        wr(a[1], json.dumps(m, indent="\t").encode())
    elif op == "stedit":
        b = rd(a[1])
        hl = struct.unpack("<Q", b[:8])[0]
        h = json.loads(b[8:8 + hl])
        data = b[8 + hl:]
        kind, _, arg = a[2].partition("=")
        if kind == "hlen":
            wr(a[1], struct.pack("<Q", int(arg)) + b[8:])
            return
        if kind == "rename":
            h[arg + ".gone"] = h.pop(arg)
        elif kind == "dtype":
            name, dt = arg.split(":")
            h[name]["dtype"] = dt
        elif kind == "shape":
            h[arg]["shape"] = [d + 1 for d in h[arg]["shape"]]
        elif kind == "shape1":
            h[arg]["shape"] = h[arg]["shape"][:1]
        elif kind == "offs":
            s, e = h[arg]["data_offsets"]
            h[arg]["data_offsets"] = [s, e + 2]
        elif kind == "offsbig":
            s, e = h[arg]["data_offsets"]
            h[arg]["data_offsets"] = [s, len(data) + 4096]
        elif kind == "offsswap":
            s, e = h[arg]["data_offsets"]
            h[arg]["data_offsets"] = [e, s]
        elif kind == "tensors":
            print("\n".join(k for k in h if k != "__metadata__"))
            return
        nh = json.dumps(h).encode()
        wr(a[1], struct.pack("<Q", len(nh)) + nh + data)
    elif op == "offsets":
        r = random.Random(int(a[1]))
        n, size = int(a[2]), int(a[3])
        out = [r.randrange(min(4096, size)) if i % 2 == 0 else r.randrange(size) for i in range(n)]
        print(" ".join(f"{o}:{r.randrange(8)}" for o in out))
    else:
        sys.exit("unknown op " + op)


if __name__ == "__main__":
    main()
