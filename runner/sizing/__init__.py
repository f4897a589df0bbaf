"""How large a step this process can run: the device, the host, and the plan made from them.

    probe.py    the GPU (pynvml, amdsmi, torch) or the CPU, and the bisection the probe steps use
    hostmem.py  host memory and CPUs as the container sees them (cgroup limits); DataLoader settings
    plan.py     the plan: tier, micro-batch, accumulation and precision from the memory model, agreed
                over ranks and checked by real probe steps
    traced.py   the starting micro-batch from a trace of the runner's own step (`memory.trace`)
    trace_cache.py  the traced line kept beside the data cache, by everything the trace depends on
"""
