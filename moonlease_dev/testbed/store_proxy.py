"""Runs in another Mooncake release's interpreter: serves `MooncakeDistributedStore` calls.

Standard library only (that interpreter has nothing else). One JSON request per stdin line,
one JSON reply per stdout line; see `StoreClientProxy` in mooncake.py for the other end.
"""

import base64
import json
import sys


def _decode(value):
    if isinstance(value, dict) and "__bytes__" in value:
        return base64.b64decode(value["__bytes__"])
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _encode(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def main():
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    out = sys.stdout
    sys.stdout = sys.stderr  # keep the protocol channel clean of library prints
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["method"] == "__dir__":  # which methods this release has
                out.write(json.dumps({"result": [n for n in dir(store) if not n.startswith("_")]}) + "\n")
                out.flush()
                continue
            method = getattr(store, request["method"])
            args = [_decode(a) for a in request["args"]]
            kwargs = {k: _decode(v) for k, v in request["kwargs"].items()}
            reply = {"result": _encode(method(*args, **kwargs))}
        except Exception as error:  # relayed to the caller, which re-raises it
            reply = {"error": {"type": type(error).__name__, "message": str(error)}}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
