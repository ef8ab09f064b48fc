/* Every other library of drasil's fake NVIDIA driver roots (e2e/harness/driverroot): an ELF
 * shared object with the real library's SONAME and nothing in it but its own name. */
#ifndef FAKE_LIBRARY
#error "compile with -DFAKE_LIBRARY=\"libnvidia-cfg.so.580.95.05\""
#endif
#ifndef FAKE_DRIVER_VERSION
#error "compile with -DFAKE_DRIVER_VERSION=\"580.95.05\""
#endif

const char drasil_fake_nvidia_library[] = FAKE_LIBRARY " (drasil fake driver " FAKE_DRIVER_VERSION ")";
