"""Cells of notebooks/inspect_guides.ipynb (built by build_notebooks.py)."""

import gpu_estimates as ge

PARAMS_EXTRA = r"""
POLICY = "runs/quickstart"  # a run directory of this project (latest Orbax checkpoint) or an HF dir / hub id
REFERENCE = None  # pi_ref: None = the run's base model (its model.path); else an HF dir / hub id
PROBLEMS = [
    r"What is the smallest positive integer $n$ such that $3n \equiv 1356 \pmod{22}$?",
    r"How many vertical asymptotes does the graph of $y=\frac{2}{x^2+x-6}$ have?",
    r"If $x + y = 10$ and $xy = 21$, what is $x^2 + y^2$?",
]
TEMPLATE = "sage"  # chat template + "Please reason step by step, ... \boxed{}."
MAX_NEW_TOKENS = 256
TEMPERATURE = 1.0  # as in training: the guides see the entropy of the sampling distribution
SEED = 0
STEP = 0  # optimizer step of the token / random guides' cosine schedules (0 = their first peak)
DATA_DIR = "runs/tfds"  # prepared TFDS datasets (SMOKE reads the procedural task from here)
COLOR_BY = "q_branch"  # signal that colours the text: q_branch, q_token, q_random, entropy, kl_branch, ...
"""

LOAD = r"""
from sage_jax.train import eval_mode
from sage_jax.defaults import TINY_BASE
from sage_jax.data.templates import format_prompt
from sage_jax.models import hf
import notebook_utils as nu

if SMOKE:  # the quickstart's tiny run when it exists in this directory, else the shipped tiny model itself
    POLICY = "runs/quickstart" if eval_mode.is_run_dir("runs/quickstart") else TINY_BASE
    from sage_jax.data import builders
    from sage_jax.data.sources import decode_record
    src = builders.load_split("procedural_arithmetic", "test", data_dir=DATA_DIR)
    PROBLEMS = [decode_record(src[i])["problem"] for i in range(3)]
    TEMPLATE, MAX_NEW_TOKENS = "chat", 48

policy, base_path = eval_mode.load_policy(POLICY)  # run dir: its checkpoint on its base; HF: the model
ref_path = REFERENCE or base_path
reference = policy if ref_path == POLICY else hf.load(ref_path)[0]
tokenizer = hf.load_tokenizer(base_path)
EOS_IDS, PAD_ID = nu.stop_and_pad(tokenizer, base_path)
GUIDES = {"branch": None, "token": None, "random": None}  # None: each guide's reference defaults
SCHEDULE_STEPS = 100  # length of the run the token / random schedules assume
if eval_mode.is_run_dir(POLICY):  # the run's own settings for the guide it trained with
    from sage_jax import config_lib
    rc = eval_mode.run_config(POLICY)
    if rc.sage.guide in GUIDES:
        GUIDES[rc.sage.guide] = config_lib.guide_config(rc)
    SCHEDULE_STEPS = rc.max_steps
print(f"policy {POLICY}\nreference {ref_path}" + ("  (same weights: every KL is 0)" if reference is policy else ""))
prompts = [format_prompt(p, TEMPLATE, tokenizer) for p in PROBLEMS]
"""

SAMPLE = r"""
signals = nu.token_signals(policy, reference, tokenizer, prompts, max_new_tokens=MAX_NEW_TOKENS,
                           temperature=TEMPERATURE, seed=SEED, eos_ids=EOS_IDS, pad_id=PAD_ID, guides=GUIDES,
                           step=STEP, max_steps=SCHEDULE_STEPS)
for i, s in enumerate(signals):
    shaped = {g[2:]: float((s[g] != 1).mean()) for g in s if g.startswith("q_")}
    print(f"[{i}] {len(s['tokens'])} tokens, reshaped fraction {shaped}\n    {s['text'][:300]!r}")
"""

HEATMAPS = r"""
for i, s in enumerate(signals):
    display(Image(nu.plot_token_heatmap(s, f"inspect_heatmap_{i}.png")))
"""

TEXT = r"""
page = "".join(nu.tokens_html(s, COLOR_BY) + "<hr>" for s in signals)
open("inspect_tokens.html", "w").write(f"<html><body>{page}</body></html>")
display(HTML(page))
"""

SCATTER = r"""
import numpy as np

display(Image(nu.plot_guide_scatter(signals, "inspect_scatter.png")))
cat = lambda k: np.concatenate([s[k] for s in signals])
rows = ["| guide | tokens with q != 1 | mean q | mean KL, shaped anchor | mean KL, GRPO anchor |", "|---|---|---|---|---|"]
for g in GUIDES:
    q, kl, kl0 = cat(f"q_{g}"), cat(f"kl_{g}"), cat("kl_none")
    rows.append(f"| {g} | {(q != 1).mean():.3f} | {q.mean():.3f} | {kl.mean():.2e} | {kl0.mean():.2e} |")
display(Markdown("\n".join(rows)))
"""


def cells(b):
    s05 = ge.KNOWN_SHAPES["Qwen/Qwen2.5-0.5B-Instruct"]
    l4 = ge.GPUS["L4"]
    sample_s = ge.sample_seconds(s05, 3, 128, 256, l4)
    return [
        ("md", f"""# Where does SAGE reshape the anchor? Per-token guides and KL

{b.badge("inspect_guides")}

Loads a policy (the quickstart's run, any run directory of this project, or an HF model) and its
reference pi_ref, samples one completion per prompt, and shows per token: the policy's entropy (and the
reference's), the value q of the **branch**, **token** and **random** guides (`sage_jax.rl.guides.compute_log_q`,
the function the RL step calls), and the per-token k3 KL estimate against GRPO's anchor pi_ref and
against each shaped anchor `q * pi_ref` (`sage_jax.rl.losses.per_token_kl`) - as heatmaps, as coloured
text, and as scatter plots. q > 1 raises the anchor on a token: the KL term is smallest at
log pi = log pi_ref + log q, so the policy may put more mass on that token before the KL pulls it back
(branch: at high-entropy forks, where reasoning paths split); q < 1 lowers it.

**Memory and time** (estimates, no GPU measured): the policy and the reference in float32 (0.5B:
2 x {ge.param_count(s05) * 4 / ge.GIB:.1f} GiB; a LoRA run shares nothing with its base here, the base
is loaded again) plus a KV cache of a few MiB: fits every Colab GPU for 0.5B and 1.5B
(2 x {ge.param_count(ge.KNOWN_SHAPES['Qwen/Qwen2.5-Math-1.5B']) * 4 / ge.GIB:.1f} GiB). Sampling 3 x 256 tokens
~{sample_s:.0f} s on an L4 plus ~1 min of compilation; `SMOKE`: ~30 s on CPU."""),
        ("code", b.params_header(PARAMS_EXTRA)),
        ("md", b.SETUP_MD),
        ("code", b.SETUP_CODE),
        ("md", "### Devices\n\n**What:** imports JAX and reports the accelerator. **Time:** seconds."),
        ("code", b.DEVICES_CODE),
        ("md", """### Load the policy and the reference

**What:** `sage_jax.train.eval_mode.load_policy` restores a run's latest checkpoint onto its base model (a LoRA
run: adapters on the base) or loads an HF model; the reference is the run's base (`REFERENCE = None`).
Uses the run's own guide settings where it has them. **Time:** ~1 min on Colab for the 0.5B download,
seconds after; `SMOKE`: ~10 s on 2 CPU cores (measured)."""),
        ("code", LOAD),
        ("md", f"""### Sample and compute the per-token signals

**What:** samples one completion per prompt (`sage_jax.sampling`), recomputes the policy's and the
reference's log-probs and entropies of those tokens (`sage_jax.policy.logprobs`, as the RL step does), then q of
each guide and the per-token KL. **Time (estimates):** L4 ~1 min (compilation) + ~{sample_s:.0f} s;
A100 similar (compilation-bound); T4 ~1.5 min; `SMOKE`: ~15 s on 2 CPU cores (measured)."""),
        ("code", SAMPLE),
        ("md", """### Heatmaps

**What:** one figure per completion: rows are the signals, columns the tokens (wrapped); q in red (> 1)
and blue (< 1) around white = 1, entropy and KL in sequential colours. Saved as
`inspect_heatmap_<i>.png`. **Time:** ~1 s per completion."""),
        ("code", HEATMAPS),
        ("md", """### Coloured text

**What:** the completions with each token's background coloured by `COLOR_BY` (hover a token for all its
values); saved as `inspect_tokens.html`. **Time:** instant."""),
        ("code", TEXT),
        ("md", """### Guides against entropy, shaped against unshaped KL

**What:** over all sampled tokens, q of each guide against the policy entropy (branch is a function of it;
token follows surprisal; random is noise), and each shaped per-token KL against GRPO's; points off the
diagonal are where SAGE changes the regulariser. Saved as `inspect_scatter.png`, with a summary table.
**Time:** ~1 s."""),
        ("code", SCATTER),
    ]
