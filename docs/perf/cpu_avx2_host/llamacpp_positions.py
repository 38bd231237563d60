"""Per position of the given check files (OUT/*.gguf of llamacpp_more_types.py, F16 dense weights):
NMSE of moelab's logits against llama.cpp's and the routing tie ratio (the smallest margin in units
of the expected rounding noise; the check leaves out ratios < 4), as pos:NMSE/rRATIO.

    python docs/perf/cpu_avx2_host/llamacpp_positions.py OUT/llama_Q4_1.gguf
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from execute import llamacpp_check as lc
target = lc.site(Path.home() / ".cache" / "moelab" / "llamacpp", "0.3.36")
for f in sys.argv[1:]:
    p = Path(f)
    quant = p.stem.split("_", 1)[1].removesuffix("_split").removesuffix("_kv_b")  # deepseek2's MLA layouts
    toks = list(lc.TOKENS)
    ref, err = lc.llamacpp_logits(target, p, toks, not lc.amx_weights(p))
    ours = lc.moelab_logits(p, toks)
    ratio = lc.routing_ties(p, toks, lc.file_formats(quant, "F16"))
    per = ((ours - ref) ** 2).sum(axis=1) / (ref ** 2).sum(axis=1)
    print(p.name, " ".join(f"{i}:{n:.1e}/r{r:.1f}" for i, (n, r) in enumerate(zip(per, ratio))))
