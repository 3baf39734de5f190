"""`moonlease bench`: the lease-policy replay benchmark (traces, real store, Belady bound).

Pure: `trace`, `workload`, `accounting`, `belady`, `stats`. Over vLLM's coordinator without
I/O: `workers`, `saves`. I/O: `stores`, `replay`, `report`, `command`, `environment`.
"""
