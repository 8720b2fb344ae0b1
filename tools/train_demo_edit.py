"""Teach the demo model to edit: one transformer for qwenfast/assets/demo-t2i and demo-edit.

The text-to-image demo transformer (tools/train_demo.py) is fine-tuned on edit pairs of the shape
world (before, instruction, after) with Qwen-Image-Edit-2509 ("Plus") conditioning, mixed with
text-to-image batches so that it keeps drawing from text. Why one transformer for both: the package
may carry 20 MB of weights and the text-to-image model alone takes 18 MB; the edit folder links to
the same transformer, VAE, text encoder and tokenizer files, so the weights ship once.

    # GPU (no diffusers needed), <= 10 min: data, embeddings, fine-tuning, both suites scored
    python tools/train_demo_edit.py train --ckpt $OUT --budget 470
    # CPU, needs diffusers: rewrite demo-t2i/transformer, write demo-edit (links + processor +
    # qwenfast.json), check both loaders draw the same images
    python tools/train_demo_edit.py export --ckpt CKPT

Conventions follow inference exactly (see qwenfast/pipeline/edit.py): the reference image is the
VAE mode of the before picture at `VAE_AREA` pixels, packed and appended after the noise tokens with
its own RoPE frame; the prompt is EDIT_TEMPLATE with "Picture 1: <vision>" + instruction, the VL
encoder seeing the before picture at `VL_AREA` pixels; the unconditional branch is the pipeline's
negative prompt " " with the same picture (10% of edit pairs train on it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import train_demo as T  # noqa: E402

from qwenfast.demo import data as D  # noqa: E402
from qwenfast.testing.tiny import SCHEDULER_CONFIG  # noqa: E402

T2I = ROOT / "qwenfast/assets/demo-t2i"
EDIT = ROOT / "qwenfast/assets/demo-edit"
VL_AREA = 64 * 64  # the VL encoder sees 64x64 (-> 56x56, 4 image tokens): the tiny encoder is frozen random
VAE_AREA = D.SIZE * D.SIZE  # reference latents at the training resolution (the released models: 1024²)
IMAGE_AREAS = {"vl_area": VL_AREA, "vae_area": VAE_AREA}
SHARED = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
log = T.log


# ============================================================================================ data


def _render_edits(args):
    """Chunk c of the edit pairs: before/after pictures, the before picture at the VL size, instruction."""
    from PIL import Image

    from qwenfast.pipeline.edit import calculate_dimensions

    seed, chunk, n, exclude = args
    rng = np.random.default_rng([seed, 7, chunk])
    vw, vh = calculate_dimensions(VL_AREA, 1.0)
    before = np.empty((n, D.SIZE, D.SIZE, 3), np.uint8)
    after = np.empty_like(before)
    vl = np.empty((n, vh, vw, 3), np.uint8)
    texts, i = [], 0
    while i < n:
        b, ins, a = D.random_edit(rng)
        if D.edit_key(b, ins) in exclude:
            continue
        before[i], after[i] = D.render(b), D.render(a)
        vl[i] = np.asarray(Image.fromarray(before[i]).resize((vw, vh), resample=Image.LANCZOS))
        texts.append(ins)
        i += 1
    return before, after, vl, texts


def make_edits(n: int, seed: int, workers: int, chunk: int = 1000):
    exclude = frozenset(D.edit_key(b, ins) for b, ins, _ in D.eval_edits())
    jobs = [(seed, c, min(chunk, n - c * chunk), exclude) for c in range(math.ceil(n / chunk))]
    with ProcessPoolExecutor(workers) as ex:
        res = list(ex.map(_render_edits, jobs))
    return tuple(np.concatenate([r[k] for r in res]) for k in range(3)) + ([t for r in res for t in r[3]],)


@torch.no_grad()
def encode_edit_texts(te, proc, vl: np.ndarray, texts: list[str], batch: int = 512):
    """The pipeline's edit conditioning for each (picture, text), batched -> (emb (N, L, D) bf16, lengths)."""
    from PIL import Image

    from qwenfast.models.text_encoder import EDIT_DROP, EDIT_TEMPLATE, VISION_SLOT

    seqs = []
    for s in range(0, len(texts), batch):
        ims = [[Image.fromarray(a)] for a in vl[s : s + batch]]
        prompts = [EDIT_TEMPLATE.format(f"Picture 1: {VISION_SLOT}{t}") for t in texts[s : s + batch]]
        seqs += [h.to(torch.bfloat16) for h in te._hidden_vl(prompts, ims, proc, EDIT_DROP)]
    return T.padded_rows(seqs)


def packed_latents(vae, imgs) -> torch.Tensor:
    """uint8 pictures -> normalised packed latents (N, 64, 64) bf16, as the pipelines compute them."""
    from qwenfast.pipeline.sampling import pack_latents

    lat = T.encode_latents(vae, imgs)
    mean = torch.tensor(vae.cfg.latents_mean, device=lat.device).view(1, -1, 1, 1)
    std = torch.tensor(vae.cfg.latents_std, device=lat.device).view(1, -1, 1, 1)
    return pack_latents((lat - mean) / std).to(torch.bfloat16)


# ============================================================================================ train


def finetune(dit, ema, edit, t2i, dev, *, steps, batch, lr, deadline, ckpt, p_edit, warmup=200, log_every=250,
             save_every=120.0):  # fmt: skip
    """Flow matching on a mix of edit batches (target = after, reference = before) and text-to-image batches."""
    from qwenfast.config import SchedulerConfig
    from qwenfast.pipeline.sampling import calculate_shift

    mu = calculate_shift(edit["x0"].shape[1], SchedulerConfig.from_dict(SCHEDULER_CONFIG))
    side = int(round(math.sqrt(edit["x0"].shape[1])))
    dit.train()
    dit.fused = False
    opt = torch.optim.AdamW(dit.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
    g = torch.Generator(device=dev).manual_seed(T.SEED + 11)
    params = [p for _, p in dit.named_parameters()]
    ema_params = dict(ema.named_parameters())
    ema_list = [ema_params[k] for k, _ in dit.named_parameters()]
    hist, run, t0, last_save = [], {"edit": [], "t2i": []}, time.time(), time.time()
    step = 0
    for step in range(steps):
        frac = max(step / steps, (time.time() - t0) / max(1e-9, deadline - t0))
        for pg in opt.param_groups:
            pg["lr"] = T.lr_at(step, lr, warmup, frac)
        is_edit = bool(torch.rand((), device=dev, generator=g) < p_edit)
        src = edit if is_edit else t2i
        idx = torch.randint(0, src["x0"].shape[0], (batch,), device=dev, generator=g)
        x0 = src["x0"][idx].float()
        drop = torch.rand(batch, device=dev, generator=g) < 0.1
        ti = torch.where(drop, src["null"][idx], src["text"][idx])
        e = src["emb"][ti].float()
        mask = (torch.arange(e.shape[1], device=dev)[None] < src["lens"][ti][:, None]).long()
        sigma = T.sample_sigmas(batch, dev, g, mu)
        noise = torch.randn(x0.shape, device=dev, generator=g)
        s = sigma[:, None, None]
        xt = (1 - s) * x0 + s * noise
        shapes = [(1, side, side)]
        if is_edit:
            xt = torch.cat([xt, src["ref"][idx].float()], dim=1)
            shapes = [(1, side, side), (1, side, side)]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            pred = dit(xt, e, mask, sigma, shapes)[:, : x0.shape[1]]
        loss = F.mse_loss(pred.float(), noise - x0)
        T.optimizer_step(opt, loss, params, ema_list, decay=min(0.999, (1 + step) / (10 + step)))
        run["edit" if is_edit else "t2i"].append(loss.detach())
        if step % log_every == 0 or step == steps - 1:
            row = {k: torch.stack(v).mean().item() for k, v in run.items() if v}
            run = {"edit": [], "t2i": []}
            hist.append({"step": step, **row, "t": time.time() - t0})
            ms = (time.time() - t0) / (step + 1) * 1e3
            log(f"step {step:6d} " + " ".join(f"{k} {v:.4f}" for k, v in row.items()) + f" ({ms:.1f} ms/step)")
        if ckpt is not None and time.time() - last_save > save_every:
            T.save_dit(ckpt, ema.state_dict())
            last_save = time.time()
        if time.time() > deadline:
            log(f"time budget reached at step {step}")
            break
    dit.eval()
    return hist, step + 1


def cmd_train(a):
    from qwenfast.loading.diffusers_folder import load_transformer, load_vae
    from qwenfast.models.text_encoder import TextEncoder
    from qwenfast.pipeline.edit import load_image_processor

    t_start, dev, ckpt = T.start_run(a)  # ~150-token sequences: plain math attention
    deadline = t_start + a.budget
    model = Path(a.model)
    metrics = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "args": vars(a)}

    log(f"rendering {a.n_edit} edit pairs and {a.n_t2i} captioned scenes on {a.workers} workers")
    before, after, vl, instr = make_edits(a.n_edit, a.seed, a.workers)
    scenes, caps = T.make_data(a.n_t2i, a.seed + 1, a.workers)
    log(f"data ready ({time.time() - t_start:.0f}s)")

    vae = load_vae(model / "vae", dev, torch.float32).eval()
    te = TextEncoder.from_pretrained(model / "text_encoder", model / "tokenizer", dev, torch.float32)
    proc = load_image_processor()
    edit = {"x0": packed_latents(vae, torch.from_numpy(after).to(dev)),
            "ref": packed_latents(vae, torch.from_numpy(before).to(dev))}  # fmt: skip
    t2i = {"x0": packed_latents(vae, torch.from_numpy(scenes).to(dev))}
    del after, scenes
    # edit texts: each pair's instruction, and the negative " " for the 10% of pairs trained unconditionally
    # (their picture is part of the prompt, so each pair has its own null embedding)
    null_rows = np.random.default_rng([a.seed, 3]).random(len(instr)) < 0.1
    texts = [" " if null else t for null, t in zip(null_rows, instr)]
    edit["emb"], edit["lens"] = encode_edit_texts(te, proc, vl, texts)
    rows = torch.arange(len(instr), device=dev)
    edit["text"] = edit["null"] = rows  # per-pair rows; the 10% drop is baked into `texts` above
    uniq = sorted(set(caps) | {T.NULL_PROMPT})
    where = {c: i for i, c in enumerate(uniq)}
    emb, lens = T.encode_texts(te, uniq)
    t2i.update(emb=emb.to(dev, torch.bfloat16), lens=lens.to(dev),
               text=torch.tensor([where[c] for c in caps], device=dev))  # fmt: skip
    t2i["null"] = torch.full_like(t2i["text"], where[T.NULL_PROMPT])
    log(f"latents and embeddings ready: edit text {tuple(edit['emb'].shape)} ({time.time() - t_start:.0f}s)")

    dit = load_transformer(model / "transformer", dev, torch.float32)
    ema = load_transformer(model / "transformer", dev, torch.float32).requires_grad_(False)
    if a.init:  # continue from an earlier run's EMA weights (same architecture, our key layout)
        for m in (dit, ema):
            m.load_state_dict(T.load_dit(Path(a.init)))
    dit.requires_grad_(True)
    metrics["init"] = a.init or str(model / "transformer")
    hist, end = finetune(dit, ema, edit, t2i, dev, steps=a.steps, batch=a.batch, lr=a.lr,
                         deadline=deadline - a.eval_reserve, ckpt=ckpt, p_edit=a.p_edit)  # fmt: skip
    T.save_dit(ckpt, ema.state_dict())
    metrics.update(history=hist, steps=end, train_time=time.time() - t_start)
    (ckpt / "metrics.json").write_text(json.dumps(metrics, indent=1))
    del dit, edit, t2i, vl, before

    metrics.update(evaluate(ema, vae, te, proc, a, ckpt, hard=t_start + a.budget + 30))
    metrics["total_time"] = time.time() - t_start
    (ckpt / "metrics.json").write_text(json.dumps(metrics, indent=1))
    log(f"done in {time.time() - t_start:.0f}s")


@torch.no_grad()
def evaluate(ema, vae, te, proc, a, ckpt: Path, hard: float) -> dict:
    """Both suites with the inference pipelines on the EMA weights: text-to-image at the shipped defaults,
    edits over a steps x CFG grid."""
    from qwenfast.config import SchedulerConfig
    from qwenfast.demo import bench
    from qwenfast.pipeline.edit import QwenImageEditPipeline
    from qwenfast.pipeline.text_to_image import QwenImagePipeline
    from qwenfast.runtime.attention import set_attention

    set_attention("auto")
    ema.fused = True
    sched = SchedulerConfig.from_dict(SCHEDULER_CONFIG)
    t2i_defaults = json.loads((Path(a.model) / "qwenfast.json").read_text())["defaults"]
    out = {}
    pipe = QwenImagePipeline(ema, vae, te, sched, defaults=t2i_defaults)
    pipe.set_progress_bar_config(disable=True)
    t2i = []
    for cfg in (float(c) for c in a.eval_t2i_cfg.split(",")):
        res, _ = bench.run_t2i(pipe, a.eval_t2i_n, cfg=cfg, batch=24)
        t2i.append({"score": res.score, "attribute": res.attribute, "per_check": res.per_check, **t2i_defaults,
                    "true_cfg_scale": cfg})  # fmt: skip
        log(f"text-to-image cfg {cfg}: {res.score:.1f}% ({res.per_check})")
    out["t2i_sweep"] = t2i
    out["t2i"] = max(t2i, key=lambda r: (r["score"], r["attribute"]))
    epipe = QwenImageEditPipeline(ema, vae, te, sched, mode="edit-plus", image_processor=proc,
                                  image_areas=IMAGE_AREAS, defaults={"num_inference_steps": 20, "true_cfg_scale": 2.0})  # fmt: skip
    epipe.set_progress_bar_config(disable=True)
    sweep = []
    for g in a.eval_grid.split(","):
        if time.time() > hard:
            log(f"eval: out of time, skipping {g}")
            continue
        steps, cfg = int(g.split("x")[0]), float(g.split("x")[1])
        res, images = bench.run_edits(epipe, a.eval_edit_n, steps=steps, cfg=cfg)
        sweep.append({"steps": steps, "cfg": cfg, "score": res.score, "attribute": res.attribute,
                      "per_check": res.per_check, "failed": [it["prompt"] for it in res.items if not it["pass"]]})  # fmt: skip
        log(f"edit steps {steps} cfg {cfg}: {res.score:.1f}% ({res.attribute:.1f}% checks) {res.per_check}")
        if len(sweep) == 1:
            k = min(12, len(images))
            befores = [D.render(b) for b, _, _ in D.eval_edits()[:k]]
            pairs = [im for pair in zip(befores, images[:k]) for im in pair]
            labels = [x for _, ins, _ in D.eval_edits()[:k] for x in ("before", ins)]
            T.grid_png(pairs, labels, ckpt / "edit_grid.png", cols=6)
    out["edit_sweep"] = sweep
    out["edit_best"] = max(sweep, key=lambda r: (r["score"], r["attribute"], -r["steps"]))
    return out


# ============================================================================================ export


def cmd_export(a):
    """demo-t2i/transformer <- the fine-tuned weights (diffusers layout, bf16); demo-edit: model_index,
    processor, qwenfast.json, and relative links to demo-t2i's shared folders."""
    import diffusers
    from transformers import AutoTokenizer

    from qwenfast.testing.tiny import build_processor

    ckpt, t2i, out = Path(a.ckpt), Path(a.t2i), Path(a.out)
    metrics = json.loads((ckpt / "metrics.json").read_text())
    dit = diffusers.QwenImageTransformer2DModel(**{**T.DIT_CFG, "axes_dims_rope": tuple(T.DIT_CFG["axes_dims_rope"])})
    dit.load_state_dict(T.dit_to_diffusers(T.load_dit(ckpt)), strict=True)
    for f in (t2i / "transformer").glob("*"):
        f.unlink()
    dit.to(torch.bfloat16).save_pretrained(str(t2i / "transformer"), safe_serialization=True)
    note_path = t2i / "qwenfast.json"
    note = json.loads(note_path.read_text())
    note["description"] = note["description"].split(" Also edits")[0] + (
        " Also edits (the same transformer, fine-tuned on edit pairs): see qwenfast/assets/demo-edit."
    )
    note["training"]["edit_finetune"] = {"device": metrics["device"], "steps": metrics["steps"],
                                         "train_time": round(metrics["train_time"], 1)}  # fmt: skip
    note["held_out_score"] = {k: metrics["t2i"][k] for k in ("score", "attribute", "per_check")}
    note["defaults"]["true_cfg_scale"] = float(metrics["t2i"].get("true_cfg_scale", note["defaults"]["true_cfg_scale"]))
    note_path.write_text(json.dumps(note, indent=2) + "\n")

    out.mkdir(parents=True, exist_ok=True)
    for name in SHARED:  # one copy of the weights: relative links into the text-to-image folder
        link = out / name
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.is_dir():
            raise SystemExit(f"{link} is a real folder; remove it first")
        link.symlink_to(Path("..") / t2i.name / name, target_is_directory=True)
    index = json.loads((t2i / "model_index.json").read_text())
    index["_class_name"] = "QwenImageEditPlusPipeline"
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    # processor/: what Qwen-Image-Edit-2509 ships (tokenizer files + Qwen2-VL image processor settings)
    build_processor(AutoTokenizer.from_pretrained(str(t2i / "tokenizer"))).save_pretrained(str(out / "processor"))
    best = metrics["edit_best"]
    enote = {
        "description": "qwenfast demo edit model (Qwen-Image-Edit-2509 layout): the demo text-to-image model's "
        "transformer, fine-tuned on edit pairs of the shape world ('make the circle red', 'move the square to "
        "the left', 'add a blue star', remove / reshape / background). Its weights are links to ../demo-t2i.",
        "built_by": "tools/train_demo_edit.py (train / export), seed 0",
        "image_areas": IMAGE_AREAS,
        "trained_size": [128, 128],  # [width, height] of the edit pairs (pipe.size_note)
        "defaults": {"num_inference_steps": int(best["steps"]), "true_cfg_scale": float(best["cfg"])},
        "held_out_score": {k: best[k] for k in ("score", "attribute", "per_check")},
    }
    (out / "qwenfast.json").write_text(json.dumps(enote, indent=2) + "\n")
    log(f"wrote {t2i}/transformer and {out}; edit defaults {enote['defaults']}, t2i score {metrics['t2i']['score']:.1f}")
    if not a.no_check:
        T.check_same_image(t2i)
        check_same_edit(out)


def check_same_edit(folder: Path, instruction: str = "make the circle red"):
    """qwenfast and diffusers' QwenImageEditPlusPipeline (its resize areas set to the model's) draw the same
    edit for the same seed (fp32, CPU)."""
    import diffusers
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    from qwenfast import QwenImageEditPipeline
    from qwenfast.testing.tiny import load_processor

    before = D.render(D.Scene("blue", (D.Obj("green", "circle", "large", "left", 40.0, 64.0, 24.0),)))
    ours = QwenImageEditPipeline.from_pretrained(folder, device="cpu", dtype=torch.float32)
    ours.set_progress_bar_config(disable=True)
    d = ours.defaults
    kw = {"num_inference_steps": d["num_inference_steps"], "true_cfg_scale": d["true_cfg_scale"], "negative_prompt": " "}
    mine = ours(before, instruction, generator=torch.Generator("cpu").manual_seed(0), output_type="np", **kw).images[0]
    saved = plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE
    plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE = VL_AREA, VAE_AREA
    try:
        theirs = diffusers.QwenImageEditPlusPipeline.from_pretrained(
            str(folder), processor=load_processor(folder / "processor"), torch_dtype=torch.float32
        )
        theirs.set_progress_bar_config(disable=True)
        from PIL import Image

        ref = theirs(image=[Image.fromarray(before)], prompt=instruction, generator=torch.Generator("cpu").manual_seed(0),
                     output_type="np", height=mine.shape[0], width=mine.shape[1], **kw).images[0]  # fmt: skip
    finally:
        plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE = saved
    diff = float(np.abs(mine - ref).max())
    log(f"edit: qwenfast vs diffusers, same seed: max abs pixel diff {diff:.2e}")
    if diff > 1e-3:
        raise SystemExit("export check FAILED: the two edit pipelines give different images")
    return diff


def cmd_grid(a):
    """docs/demo-edit-grid.png: held-out edits with the shipped model on CPU (before | after pairs)."""
    from qwenfast import QwenImageEditPipeline
    from qwenfast.demo import bench

    pipe = QwenImageEditPipeline.from_pretrained(a.model, device="cpu", dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    res, images = bench.run_edits(pipe, a.n)
    suite = D.eval_edits()[: a.n]
    pairs = [im for (b, _, _), after in zip(suite, images) for im in (D.render(b), after)]
    labels = [x for _, ins, _ in suite for x in ("before:", ins)]
    marks = [m for it in res.items for m in (None, it["pass"])]
    T.grid_png(pairs, labels, a.out, cols=a.cols, marks=marks)
    log(f"wrote {a.out}: {sum(it['pass'] for it in res.items)}/{a.n} edits pass")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--model", default=str(T2I), help="the text-to-image demo folder to start from")
    t.add_argument("--ckpt", required=True)
    t.add_argument("--seed", type=int, default=T.SEED)
    t.add_argument("--n-edit", type=int, default=60_000)
    t.add_argument("--n-t2i", type=int, default=60_000)
    t.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    t.add_argument("--budget", type=float, default=470, help="seconds for the whole run")
    t.add_argument("--steps", type=int, default=30_000)
    t.add_argument("--batch", type=int, default=256)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--p-edit", type=float, default=0.7, help="fraction of batches that are edit pairs")
    t.add_argument("--eval-reserve", type=float, default=80)
    t.add_argument("--eval-grid", default="20x2,20x3,20x1.5,30x3")
    t.add_argument("--eval-t2i-n", type=int, default=120)
    t.add_argument("--eval-t2i-cfg", default="2,3", help="text-to-image CFG scales to score (20 steps)")
    t.add_argument("--init", default=None, help="checkpoint folder whose EMA transformer to continue")
    t.add_argument("--eval-edit-n", type=int, default=36)
    e = sub.add_parser("export")
    e.add_argument("--ckpt", required=True)
    e.add_argument("--t2i", default=str(T2I))
    e.add_argument("--out", default=str(EDIT))
    e.add_argument("--no-check", action="store_true")
    gr = sub.add_parser("grid", help="picture grid of held-out edits (docs/demo-edit-grid.png)")
    gr.add_argument("--model", default=str(EDIT))
    gr.add_argument("--out", default=str(ROOT / "docs/demo-edit-grid.png"))
    gr.add_argument("--n", type=int, default=8)
    gr.add_argument("--cols", type=int, default=8)
    a = ap.parse_args(argv)
    {"train": cmd_train, "export": cmd_export, "grid": cmd_grid}[a.cmd](a)


if __name__ == "__main__":
    main()
