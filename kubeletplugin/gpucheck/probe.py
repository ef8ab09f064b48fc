"""What runs inside the sandbox: load the driver's libraries as a CUDA program would.

Run as a script (``python3 -I -S probe.py``) by the host's own interpreter, the one
thing in the sandbox that the CDI spec did not put there; it imports nothing but the
standard library (and nothing of drasil: the sandbox holds no drasil). It loads
``libcuda.so.1`` and ``libnvidia-ml.so.1`` by SONAME, through the links and library
path the spec's hooks stand for, and prints one JSON object: what CUDA and NVML see.
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

NAME_LEN = 256
NVML_UUID_LEN = 96


def _fn(lib: ctypes.CDLL, *names: str) -> Any:
    """The first of ``names`` the library exports (newer ABIs first), or None."""
    for name in names:
        try:
            return getattr(lib, name)
        except AttributeError:
            continue
    return None


def _cuda_uuid(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _cuda_device(lib: ctypes.CDLL, ordinal: int) -> dict[str, Any]:
    """Name and UUID of CUDA device ``ordinal``, where the library has the calls."""
    get = _fn(lib, "cuDeviceGet")
    if get is None:
        return {"ordinal": ordinal, "note": "no cuDeviceGet"}
    dev = ctypes.c_int()
    rc = get(ctypes.byref(dev), ordinal)
    found: dict[str, Any] = {"ordinal": ordinal, "cuDeviceGet": rc}
    name_fn = _fn(lib, "cuDeviceGetName")
    if rc == 0 and name_fn is not None:
        buf = ctypes.create_string_buffer(NAME_LEN)
        if name_fn(buf, NAME_LEN, dev) == 0:
            found["name"] = buf.value.decode(errors="replace")
    uuid_fn = _fn(lib, "cuDeviceGetUuid_v2", "cuDeviceGetUuid")
    if rc == 0 and uuid_fn is not None:
        raw = ctypes.create_string_buffer(16)
        if uuid_fn(raw, dev) == 0:
            found["uuid"] = _cuda_uuid(raw.raw)
    return found


def cuda() -> dict[str, Any]:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        return {"error": f"dlopen libcuda.so.1: {err}"}
    out: dict[str, Any] = {"cuInit": lib.cuInit(0)}
    if out["cuInit"] != 0:
        return out
    count = ctypes.c_int(-1)
    out["cuDeviceGetCount"] = lib.cuDeviceGetCount(ctypes.byref(count))
    out["count"] = count.value
    version = ctypes.c_int(0)
    if (
        _fn(lib, "cuDriverGetVersion") is not None
        and lib.cuDriverGetVersion(ctypes.byref(version)) == 0
    ):
        out["driverVersion"] = version.value
    out["devices"] = [_cuda_device(lib, i) for i in range(max(count.value, 0))]
    return out


def nvml() -> dict[str, Any]:
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as err:
        return {"error": f"dlopen libnvidia-ml.so.1: {err}"}
    out: dict[str, Any] = {"nvmlInit_v2": lib.nvmlInit_v2()}
    if out["nvmlInit_v2"] != 0:
        return out
    try:
        count = ctypes.c_uint(0)
        out["nvmlDeviceGetCount_v2"] = lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
        out["count"] = count.value
        out["uuids"] = [_nvml_uuid(lib, i) for i in range(count.value)]
    finally:
        lib.nvmlShutdown()
    return out


def _nvml_uuid(lib: ctypes.CDLL, index: int) -> str:
    handle = ctypes.c_void_p()
    rc = lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle))
    if rc != 0:
        return f"<nvmlDeviceGetHandleByIndex_v2({index}) = {rc}>"
    buf = ctypes.create_string_buffer(NVML_UUID_LEN)
    rc = lib.nvmlDeviceGetUUID(handle, buf, NVML_UUID_LEN)
    return buf.value.decode() if rc == 0 else f"<nvmlDeviceGetUUID = {rc}>"


def main() -> int:
    json.dump({"cuda": cuda(), "nvml": nvml()}, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
