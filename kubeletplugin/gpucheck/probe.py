"""What runs inside the sandbox: load the driver's libraries as a CUDA program would.

Run as a script (``python3 -I -S probe.py``) by the host's own interpreter, the one
thing in the sandbox that the CDI spec did not put there; it imports nothing but the
standard library (and nothing of drasil: the sandbox holds no drasil). It loads
``libcuda.so.1`` and ``libnvidia-ml.so.1`` by SONAME, through the links and library
path the spec's hooks stand for, and prints one JSON object: what CUDA and NVML see.

``--client MIB`` (the MPS step) makes it a CUDA client instead: a context on device 0
(under MPS, through the daemon the spec's pipe directory leads to), then what the
context may use: free memory, multiprocessors, and whether ``MIB`` + 256 MiB can be
allocated (it must not be, under a share of ``MIB``) while 256 MiB can.
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

NAME_LEN = 256
NVML_UUID_LEN = 96
MULTIPROCESSOR_COUNT = 16  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
OVER_MIB = 256
_MIB = 1 << 20


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
    if rc == 0 and (sms := _multiprocessors(lib, dev)) is not None:
        found["multiprocessors"] = sms
    return found


def _multiprocessors(lib: ctypes.CDLL, dev: ctypes.c_int) -> int | None:
    """The device's SM count; under MPS, what the active thread percentage leaves."""
    attribute = _fn(lib, "cuDeviceGetAttribute")
    value = ctypes.c_int(0)
    if attribute is None or attribute(ctypes.byref(value), MULTIPROCESSOR_COUNT, dev) != 0:
        return None
    return value.value


def _allocates(lib: ctypes.CDLL, mib: int) -> int:
    """cuMemAlloc of ``mib`` MiB (freed again): its return code."""
    alloc, free = _fn(lib, "cuMemAlloc_v2", "cuMemAlloc"), _fn(lib, "cuMemFree_v2", "cuMemFree")
    pointer = ctypes.c_uint64(0)
    rc = int(alloc(ctypes.byref(pointer), ctypes.c_size_t(mib * _MIB)))
    if rc == 0 and free is not None:
        free(pointer)
    return rc


def client(limit_mib: int) -> dict[str, Any]:
    """A CUDA client's view of what it may use (``--client``)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        return {"error": f"dlopen libcuda.so.1: {err}"}
    out: dict[str, Any] = {"cuInit": lib.cuInit(0)}
    dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
    if out["cuInit"] != 0 or lib.cuDeviceGet(ctypes.byref(dev), 0) != 0:
        return out
    out["multiprocessors"] = _multiprocessors(lib, dev)
    create = _fn(lib, "cuCtxCreate_v2", "cuCtxCreate")
    out["cuCtxCreate"] = create(ctypes.byref(ctx), 0, dev)
    if out["cuCtxCreate"] != 0:
        return out
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    info = _fn(lib, "cuMemGetInfo_v2", "cuMemGetInfo")
    out["cuMemGetInfo"] = info(ctypes.byref(free), ctypes.byref(total))
    out["freeMiB"], out["totalMiB"] = free.value // _MIB, total.value // _MIB
    out["allocSmall"] = _allocates(lib, OVER_MIB)
    out["allocOverLimit"] = _allocates(lib, limit_mib + OVER_MIB)
    return out


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
    if sys.argv[1:2] == ["--client"]:
        json.dump({"client": client(int(sys.argv[2]))}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    json.dump({"cuda": cuda(), "nvml": nvml()}, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
