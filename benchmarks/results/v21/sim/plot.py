import json, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
rows=[json.loads(l) for l in open("benchmarks/results/v21/sim/rows.jsonl")]
topos=["1x2","2x4","2x8"]; labels=sorted({r["label"] for r in rows})
fig,ax=plt.subplots(figsize=(7,4))
w=0.38
for i,lab in enumerate(labels):
    ys=[next(r["predicted_ms"] for r in rows if r["label"]==lab and r["topology"]==t) for t in topos]
    xs=[j+(i-0.5)*w for j in range(len(topos))]
    ax.bar(xs, ys, w, label=lab)
    for x,y in zip(xs,ys): ax.text(x,y,f"{y:.2f}",ha="center",va="bottom",fontsize=8)
ax.set_xticks(range(len(topos))); ax.set_xticklabels(topos)
ax.set_ylabel("predicted ms (simulator, H200 profile)")
ax.set_title("Llama-8B-size layer, TP+SP, bf16, S=4096: predicted, not measured")
ax.legend(fontsize=8); fig.tight_layout(); fig.savefig("benchmarks/results/v21/sim/predicted.png", dpi=110)
