import sys, os
sys.path.insert(0, os.getcwd())
from concurrent.futures import ThreadPoolExecutor
import tessera as ts
from tessera.quant import WEIGHT_TYPES
from tessera.kernels import lowbit_gemm, lowbit_gemm_rs
from tessera.kernels.lowbit_dequant import make_dequant_units
ks = []
for t in WEIGHT_TYPES:
    z = t.kind == "uint"
    ks += [lowbit_gemm.make_lowbit_gemm(t, 128, z, c) for c in lowbit_gemm.buildable_configs(t, 128, z)]
    ks += [lowbit_gemm_rs.make_lowbit_gemm_rs(t, 128, z, c) for c in lowbit_gemm_rs.CONFIGS if not lowbit_gemm_rs.problems(t, 128, z, c)]
    ks.append(make_dequant_units(t, 128, z, 2))
with ThreadPoolExecutor(16) as ex:
    list(ex.map(lambda k: k.build(), ks))
print("prebuilt", len(ks))
