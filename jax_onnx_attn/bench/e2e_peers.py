"""The e2e bench's peers: the same decoder written by hand in JAX and in torch, on the same weights.

Both read a builder-shaped llama graph (onnxruntime-genai's model builder or `jax_onnx_attn.models`)
through `DecoderSpec.from_lowered` on an unfused lowering (`load(path, fuse=False)`: the graph as
written), which finds each weight by the builder's node names and takes the arrays from its params:
the same weights as ours, in the producer's layout (torch shares the jax-peer's buffers through
DLPack, no copy).

jax-peer: RMSNorm in float32, one fused QKV product, rotary (non-interleaved, cos/sin rows of the
model's caches), the KV cache [B, C, Hkv, D] updated with `lax.dynamic_update_slice`,
`jax.nn.dot_product_attention(implementation="cudnn")` (masked to the valid keys with
key_value_seq_lengths; "xla" where cuDNN refuses: the implementation used is recorded), SwiGLU,
plain half-precision dots (no preferred_element_type: XLA's GEMMs accumulate in float32 inside), the
LM head at every position of a prompt (as the graph computes it). Decode runs K greedy steps in one
jitted `lax.fori_loop`, the cache donated. MatMulNBits weights are dequantised inside the jit from the
packed bytes, scales and zero points ((code - zp) * scale in the model's dtype), which XLA fuses into
or next to the product: the weight stays packed in HBM.

torch-peer: the same step with `F.linear` on the [K, N] weights seen as [N, K] (a transposed view,
no copy), `F.scaled_dot_product_attention` (GQA as [B, Hkv, group, D] queries against the
[B, Hkv, C, D] static cache, a boolean mask of the valid keys; causal with enable_gqa for prompts),
`index_copy_` into the static cache; K decode steps captured in one CUDA graph (eager on a CPU);
with compile=True (the bench's --torch-compile) the step is torch.compile'd before the capture.
Quantised (MatMulNBits) models are not run: core torch has no packed int4/int8 weight-only GEMM, and
a dequantised copy would stream 4x the bytes, so it would not be a peer of an int4 decoder.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


class PeerUnsupported(RuntimeError):
    """The peer cannot run this model; the message says why (recorded as the impl's skip)."""


@dataclass(frozen=True)
class Proj:
    """One projection: a dense [K, N] weight, or MatMulNBits' packed inputs."""

    names: tuple[str, ...]        # dense: (W,); nbits: (packed, scales[, zero_points])
    k: int
    n: int
    bits: int = 0                 # 0: dense
    block_size: int = 0


@dataclass(frozen=True)
class LayerSpec:
    """The weights of one decoder layer (param names)."""

    input_norm: str
    post_norm: str
    qkv: Proj
    o: Proj
    gate: Proj
    up: Proj
    down: Proj


@dataclass(frozen=True)
class DecoderSpec:
    """A builder-shaped llama decoder as the peers need it: param names and shape."""

    embed: str
    layers: tuple[LayerSpec, ...]
    final_norm: str
    lm_head: Proj
    cos: str
    sin: str
    heads: int
    kv_heads: int
    head_size: int
    scale: float
    eps: float
    vocab: int
    hidden: int

    @property
    def quantized(self) -> bool:
        """True when any projection is MatMulNBits."""
        return any(p.bits for layer in self.layers for p in (layer.qkv, layer.o, layer.gate, layer.up,
                                                            layer.down)) or bool(self.lm_head.bits)

    def param_names(self) -> list[str]:
        """Every param the peers read."""
        names = [self.embed, self.final_norm, self.cos, self.sin, *self.lm_head.names]
        for layer in self.layers:
            names += [layer.input_norm, layer.post_norm]
            for p in (layer.qkv, layer.o, layer.gate, layer.up, layer.down):
                names += list(p.names)
        return names

    @classmethod
    def from_lowered(cls, lowered) -> "DecoderSpec":
        """Read the spec off a lowered builder-shaped graph; PeerUnsupported names what is missing
        or different (another family, windows, softcap, interleaved rotary, ...)."""
        nodes = {n.name: n for n in lowered.model.graph.node}
        params = lowered.params

        def node(name):
            if name not in nodes:
                raise PeerUnsupported(f"the peers read builder-shaped llama graphs: node {name!r} is "
                                      "missing")
            return nodes[name]

        def attrs(n):
            import onnx
            return {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}

        def proj(where):
            if f"{where}/MatMul" in nodes:
                w = node(f"{where}/MatMul").input[1]
                if w not in params:
                    raise PeerUnsupported(f"{where}/MatMul's weight {w!r} is not an initializer")
                k, n = params[w].shape
                return Proj((w,), int(k), int(n))
            for bits in (4, 8):
                if f"{where}/MatMul_Q{bits}" in nodes:
                    nd = nodes[f"{where}/MatMul_Q{bits}"]
                    a = attrs(nd)
                    names = tuple(x for x in list(nd.input)[1:4] if x)
                    if len(nd.input) > 4 and any(nd.input[4:]):
                        raise PeerUnsupported(f"{nd.name}: g_idx / bias inputs are not supported")
                    return Proj(names, int(a["K"]), int(a["N"]), int(a["bits"]), int(a["block_size"]))
            raise PeerUnsupported(f"the peers read builder-shaped llama graphs: no {where}/MatMul(_Q4/_Q8)")

        gqas = [n for n in lowered.model.graph.node if n.op_type == "GroupQueryAttention"]
        if not gqas:
            raise PeerUnsupported("the peers need com.microsoft GroupQueryAttention layers")
        a = attrs(gqas[0])
        for g in gqas:
            b = attrs(g)
            if (b.get("local_window_size", -1) != -1 or b.get("softcap", 0.0) != 0.0
                    or b.get("rotary_interleaved", 0) or not b.get("do_rotary", 0)
                    or b != a or any(list(g.input)[1:3])):
                raise PeerUnsupported(f"{g.name}: the peers take packed QKV, non-interleaved rotary, "
                                      "no window or softcap, the same attributes in every layer")
        layers = []
        eps = None
        for i in range(len(gqas)):
            n = f"/model/layers.{i}"
            norm_in = node(f"{n}/input_layernorm/LayerNorm") if i == 0 else node(f"{n}/input_layernorm/SkipLayerNorm")
            post = node(f"{n}/post_attention_layernorm/SkipLayerNorm")
            eps = float(attrs(post)["epsilon"])
            layers.append(LayerSpec(
                input_norm=norm_in.input[1] if i == 0 else norm_in.input[2], post_norm=post.input[2],
                qkv=proj(f"{n}/attn/qkv_proj"), o=proj(f"{n}/attn/o_proj"),
                gate=proj(f"{n}/mlp/gate_proj"), up=proj(f"{n}/mlp/up_proj"),
                down=proj(f"{n}/mlp/down_proj")))
        final = node(f"/model/layers.{len(gqas)}/final_norm_layernorm/SkipLayerNorm")
        embed = node("/model/embed_tokens/Gather").input[0]
        heads, kv_heads = int(a["num_heads"]), int(a["kv_num_heads"])
        qkv_n = layers[0].qkv.n
        head_size = qkv_n // (heads + 2 * kv_heads)
        lm = proj("/lm_head")
        return cls(embed=embed, layers=tuple(layers), final_norm=final.input[2], lm_head=lm,
                   cos=gqas[0].input[7], sin=gqas[0].input[8], heads=heads, kv_heads=kv_heads,
                   head_size=head_size, scale=float(a.get("scale") or 1.0 / np.sqrt(head_size)),
                   eps=eps, vocab=lm.n, hidden=layers[0].qkv.k)


# --------------------------------------------------------------------------------------------------
# jax-peer

class JaxPeer:
    """The hand-written JAX decoder (see the module doc) on a lowered model's params.

    Attributes:
      attention: "cudnn", "xla" or "xla-f32" (CPU), the jax.nn.dot_product_attention implementation
        in use.
      attention_note: why a fallback was taken, when one was.
    """

    def __init__(self, lowered, attention: str = "cudnn"):
        self.spec = DecoderSpec.from_lowered(lowered)
        self.params = {n: lowered.params[n] for n in self.spec.param_names()}
        self.dtype = self.params[self.spec.embed].dtype
        self.attention = attention
        self.attention_note = None

    # -- math --------------------------------------------------------------------------------
    def _rms(self, x, w):
        import jax.numpy as jnp
        from jax import lax
        xf = x.astype(jnp.float32)
        y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.spec.eps)
        return (y * w.astype(jnp.float32)).astype(x.dtype)

    def _weight(self, p, proj: Proj):
        """The [K, N] weight (dense) or its in-jit dequantisation ([N, K], transposed=True)."""
        import jax.numpy as jnp
        from jax import lax
        if not proj.bits:
            return p[proj.names[0]], False
        packed, scales = p[proj.names[0]], p[proj.names[1]]
        n, kb, _ = packed.shape
        if proj.bits == 4:
            # uint8 -> uint4 pairs (low nibble first): XLA sees a 4-bit operand it can fuse into the
            # product rather than shifts and masks.
            codes = lax.bitcast_convert_type(packed, jnp.uint4).reshape(n, kb, -1)
        else:
            codes = packed
        dt = self.dtype
        if len(proj.names) > 2:
            zp = p[proj.names[2]]
            if proj.bits == 4:
                zp = lax.bitcast_convert_type(zp, jnp.uint4).reshape(n, -1)
            zp = zp[:, :kb, None].astype(dt)
        else:
            zp = jnp.asarray(1 << (proj.bits - 1), dt)
        w = (codes.astype(dt) - zp) * scales.reshape(n, kb, 1).astype(dt)
        return w.reshape(n, kb * proj.block_size)[:, :proj.k], True

    def _proj(self, p, x, proj: Proj):
        import jax.numpy as jnp
        w, transposed = self._weight(p, proj)
        if transposed:
            return jnp.einsum("...k,nk->...n", x, w)
        return x @ w

    def _rope(self, x, cos, sin):
        """x [B, S, H, D]; cos/sin [B or 1, S, D/2] (float32): non-interleaved rotation."""
        import jax.numpy as jnp
        half = x.shape[-1] // 2
        xf = x.astype(jnp.float32)
        x1, x2 = xf[..., :half], xf[..., half:]
        c, s = cos[:, :, None, :], sin[:, :, None, :]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)

    def _attend(self, q, k, v, **kw):
        import jax
        import jax.numpy as jnp
        if self.attention == "xla-f32":  # XLA on a CPU has no half dot with float32 accumulation
            out = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                               v.astype(jnp.float32), scale=self.spec.scale,
                                               implementation="xla", **kw)
            return out.astype(q.dtype)
        return jax.nn.dot_product_attention(q, k, v, scale=self.spec.scale, implementation=self.attention,
                                            **kw)

    def forward(self, p, ids, pos0, caches, prefill: bool, last_only: bool = False):
        """ids int32 [B, S] at positions pos0 .. pos0 + S - 1 (pos0 a traced scalar) -> (logits
        [B, S, V], caches). A prefill (pos0 = 0) attends causally over its own keys; a decode step
        over the cache's first pos0 + S keys. last_only: the LM head on the last position alone
        (logits [B, 1, V]), as a prompt's first token needs and our session does."""
        import jax.numpy as jnp
        from jax import lax
        sp = self.spec
        b, s = ids.shape
        d, hq, hkv = sp.head_size, sp.heads, sp.kv_heads
        positions = pos0 + jnp.arange(s, dtype=jnp.int32)
        cos = p[sp.cos][positions].astype(jnp.float32)[None]
        sin = p[sp.sin][positions].astype(jnp.float32)[None]
        x = p[sp.embed][ids]
        h = self._rms(x, p[sp.layers[0].input_norm])
        new_caches = []
        for i, (layer, (kc, vc)) in enumerate(zip(sp.layers, caches)):
            qkv = self._proj(p, h, layer.qkv)
            q = qkv[..., :hq * d].reshape(b, s, hq, d)
            k = qkv[..., hq * d:(hq + hkv) * d].reshape(b, s, hkv, d)
            v = qkv[..., (hq + hkv) * d:].reshape(b, s, hkv, d)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            kc = lax.dynamic_update_slice(kc, k.astype(kc.dtype), (0, pos0, 0, 0))
            vc = lax.dynamic_update_slice(vc, v.astype(vc.dtype), (0, pos0, 0, 0))
            new_caches.append((kc, vc))
            if prefill:
                attn = self._attend(q, k, v, is_causal=True)
            else:
                lens = jnp.full((b,), pos0 + s, jnp.int32)
                attn = self._attend(q, kc, vc, key_value_seq_lengths=lens)
            x = x + self._proj(p, attn.reshape(b, s, hq * d), layer.o)
            h = self._rms(x, p[layer.post_norm])
            gate = self._proj(p, h, layer.gate)
            act = gate * jax_sigmoid(gate) * self._proj(p, h, layer.up)
            x = x + self._proj(p, act, layer.down)
            nxt = sp.layers[i + 1].input_norm if i + 1 < len(sp.layers) else sp.final_norm
            h = self._rms(x, p[nxt])
        return self._proj(p, h[:, -1:] if last_only else h, sp.lm_head), new_caches

    # -- jitted entry points ------------------------------------------------------------------
    def new_caches(self, batch: int, capacity: int, seed: int = 0):
        """Per layer (K, V) [B, C, Hkv, D] of random normal values (not zeros: real data)."""
        import jax
        sp = self.spec
        shape = (batch, capacity, sp.kv_heads, sp.head_size)
        key = jax.random.PRNGKey(seed)
        fill = _normal_fill()
        return [(fill(jax.random.fold_in(key, 2 * i), shape, self.dtype),
                 fill(jax.random.fold_in(key, 2 * i + 1), shape, self.dtype)) for i in range(len(sp.layers))]

    def decode_fn(self, steps: int):
        """jit(params, caches, tok int32 [B], pos0) -> (caches, tokens int32 [steps, B]): `steps`
        greedy steps from position pos0, caches donated."""
        import jax
        import jax.numpy as jnp
        from jax import lax

        def run(p, caches, tok, pos0):
            def body(i, carry):
                caches, tok, toks = carry
                logits, caches = self.forward(p, tok[:, None], pos0 + i, caches, prefill=False)
                tok = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
                return caches, tok, toks.at[i].set(tok)

            toks = jnp.zeros((steps, tok.shape[0]), jnp.int32)
            caches, _, toks = lax.fori_loop(0, steps, body, (caches, tok, toks))
            return caches, toks

        return jax.jit(run, donate_argnums=(1,))

    def prefill_fn(self):
        """jit(params, ids int32 [B, S], caches) -> (logits [B, 1, V] of the last position, caches,
        first tokens [B])."""
        import jax
        import jax.numpy as jnp

        def run(p, ids, caches):
            logits, caches = self.forward(p, ids, jnp.zeros((), jnp.int32), caches, prefill=True,
                                          last_only=True)
            return logits, caches, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

        return jax.jit(run, donate_argnums=(2,))

    def compile_with_fallback(self, make, *args):
        """`make()`'s jitted function lowered and compiled for args; when cuDNN attention refuses
        (or is absent, e.g. on a CPU), switches to "xla", records why, and compiles again ("xla-f32",
        attention in float32, where XLA has no half-precision attention: on a CPU)."""
        order = ("cudnn", "xla", "xla-f32")
        while True:
            try:
                return make().lower(*args).compile()
            except Exception as e:  # cuDNN: unsupported shape / mask / platform
                i = order.index(self.attention) if self.attention in order else len(order)
                if i + 1 >= len(order):
                    raise
                note = f"{self.attention} refused: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                self.attention_note = note if not self.attention_note else f"{self.attention_note}; {note}"
                self.attention = order[i + 1]


def jax_sigmoid(x):
    """jax.nn.sigmoid (imported lazily)."""
    import jax
    return jax.nn.sigmoid(x)


_FILL = {}


def _normal_fill():
    """jit(key, shape, dtype) -> N(0, 1) array, generated in its own dtype (no float32 copy)."""
    if "f" not in _FILL:
        import functools

        import jax

        @functools.partial(jax.jit, static_argnums=(1, 2))
        def fill(key, shape, dtype):
            return jax.random.normal(key, shape, dtype)

        _FILL["f"] = fill
    return _FILL["f"]


# --------------------------------------------------------------------------------------------------
# torch-peer

def torch_status() -> tuple[object, str | None]:
    """(torch module, None) when torch imports, else (None, why)."""
    try:
        import torch
    except ImportError as e:
        return None, f"torch not installed ({e})"
    return torch, None


class TorchPeer:
    """The decoder in torch (see the module doc) on the lowered model's device buffers.

    Attributes:
      shared: True when every weight was shared through DLPack (no copy).
      compiled: True when the decode step is torch.compile'd (inductor kernels, then the CUDA graph).
    """

    def __init__(self, lowered, device: str | None = None, compile: bool = False):
        torch, why = torch_status()
        if torch is None:
            raise PeerUnsupported(why)
        self.torch = torch
        self.spec = DecoderSpec.from_lowered(lowered)
        if self.spec.quantized:
            raise PeerUnsupported("MatMulNBits weights: core torch has no packed int4/int8 weight-only "
                                  "GEMM; a dequantised copy would stream 4x the bytes")
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.shared = True
        self.w = {}
        for name in self.spec.param_names():
            self.w[name] = self._share(lowered.params[name])
        #: The decode step the graph captures: forward, or torch.compile(forward) when asked.
        self.compiled = bool(compile)
        self.step = torch.compile(self.forward, dynamic=False) if compile else self.forward

    def _share(self, arr):
        torch = self.torch
        try:
            t = torch.from_dlpack(arr)
            if t.device.type != torch.device(self.device).type:
                raise RuntimeError(f"DLPack gave {t.device}")
            return t
        except Exception:  # an older jax / torch pair: copy (recorded)
            self.shared = False
            host = np.asarray(arr)
            if host.dtype.name == "bfloat16":
                return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16).to(self.device)
            return torch.from_numpy(np.ascontiguousarray(host)).to(self.device)

    def _rms(self, x, w):
        torch = self.torch
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.eps)
        return (y * w.float()).to(x.dtype)

    def _lin(self, x, proj: Proj):
        return self.torch.nn.functional.linear(x, self.w[proj.names[0]].t())

    def _rope(self, x, cos, sin):
        """x [B, H, S, D]; cos/sin [S, D/2] float32."""
        torch = self.torch
        half = x.shape[-1] // 2
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def new_caches(self, batch: int, capacity: int, seed: int = 0):
        """Per layer (K, V) [B, Hkv, C, D] of random normal values."""
        torch = self.torch
        sp = self.spec
        g = torch.Generator(device=self.device).manual_seed(seed)
        dt = self.w[sp.embed].dtype
        return [tuple(torch.randn(batch, sp.kv_heads, capacity, sp.head_size, dtype=dt,
                                  device=self.device, generator=g) for _ in range(2))
                for _ in sp.layers]

    def forward(self, ids, pos, caches, prefill: bool, last_only: bool = False):
        """ids [B, S] (long) at positions pos .. pos + S - 1 (pos: a long tensor [1]) -> logits
        [B, S, V] ([B, 1, V] of the last position with last_only); writes the new K/V into
        `caches` in place."""
        torch = self.torch
        F = torch.nn.functional
        sp = self.spec
        b, s = ids.shape
        d, hq, hkv = sp.head_size, sp.heads, sp.kv_heads
        positions = pos + torch.arange(s, device=ids.device)
        cos = self.w[sp.cos].index_select(0, positions).float()
        sin = self.w[sp.sin].index_select(0, positions).float()
        x = F.embedding(ids, self.w[sp.embed])
        h = self._rms(x, self.w[sp.layers[0].input_norm])
        for i, (layer, (kc, vc)) in enumerate(zip(sp.layers, caches)):
            qkv = self._lin(h, layer.qkv)
            q = qkv[..., :hq * d].view(b, s, hq, d).transpose(1, 2)
            k = qkv[..., hq * d:(hq + hkv) * d].view(b, s, hkv, d).transpose(1, 2)
            v = qkv[..., (hq + hkv) * d:].view(b, s, hkv, d).transpose(1, 2)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            kc.index_copy_(2, positions, k)
            vc.index_copy_(2, positions, v)
            if prefill:
                try:
                    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=sp.scale,
                                                          enable_gqa=True)
                except TypeError:  # torch without enable_gqa
                    rep = hq // hkv
                    attn = F.scaled_dot_product_attention(
                        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True,
                        scale=sp.scale)
                attn = attn.transpose(1, 2).reshape(b, s, hq * d)
            else:
                # GQA decode: the group's query heads are the query rows of their KV head.
                qg = q.reshape(b, hkv, (hq // hkv) * s, d)
                valid = (torch.arange(kc.shape[2], device=ids.device) <= positions[-1])[None]
                attn = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=valid, scale=sp.scale)
                attn = attn.reshape(b, hq, s, d).transpose(1, 2).reshape(b, s, hq * d)
            x = x + self._lin(attn, layer.o)
            h = self._rms(x, self.w[layer.post_norm])
            gate = self._lin(h, layer.gate)
            x = x + self._lin(F.silu(gate) * self._lin(h, layer.up), layer.down)
            nxt = sp.layers[i + 1].input_norm if i + 1 < len(sp.layers) else sp.final_norm
            h = self._rms(x, self.w[nxt])
        return self._lin(h[:, -1:] if last_only else h, sp.lm_head)

    def decoder(self, batch: int, caches, steps: int):
        """A `TorchDecoder`: `steps` greedy steps from (tok, pos0) per call, in a CUDA graph on a GPU."""
        return TorchDecoder(self, batch, caches, steps)


class TorchDecoder:
    """K greedy decode steps of a TorchPeer as one callable; set `tok` / `pos0` before a call.

    On CUDA the K steps are captured once in a CUDA graph (inputs and outputs are static tensors:
    tok [B], pos0 [1], toks [K, B]); `__call__` replays it. On a CPU they run eagerly.
    """

    def __init__(self, peer: TorchPeer, batch: int, caches, steps: int):
        torch = peer.torch
        self.peer, self.caches, self.steps = peer, caches, steps
        dev = peer.device
        self.tok = torch.zeros(batch, dtype=torch.long, device=dev)
        self.pos0 = torch.zeros(1, dtype=torch.long, device=dev)
        self._pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.toks = torch.zeros(steps, batch, dtype=torch.long, device=dev)
        self.graph = None
        if dev.startswith("cuda"):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():
                self._run()  # warm-up outside the graph (workspaces, kernel choice)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: JAX's threads may free buffers (CUDA calls) while torch captures; in
            # the default global mode that invalidates the capture (jax with preallocation off).
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"), torch.no_grad():
                self._run()

    def _run(self):
        torch = self.peer.torch
        self._pos.copy_(self.pos0)
        tok = self.tok
        for i in range(self.steps):
            logits = self.peer.step(tok[:, None], self._pos, self.caches, prefill=False)
            nxt = torch.argmax(logits[:, 0], dim=-1)
            self.toks[i].copy_(nxt)
            tok = self.toks[i]
            self._pos.add_(1)

    def __call__(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            with self.peer.torch.no_grad():
                self._run()

    def sync(self):
        """Wait for the device."""
        if self.peer.device.startswith("cuda"):
            self.peer.torch.cuda.synchronize()


__all__ = ["DecoderSpec", "LayerSpec", "Proj", "JaxPeer", "TorchPeer", "TorchDecoder", "PeerUnsupported",
           "torch_status", "jax_sigmoid"]
