"""Source of a layer's dispatch, expert call and combine (:func:`dispatch_lines`), after its router.

Inputs (names in the forward): ``x_TH``, ``w_TK``, ``idx_TK``, ``T H E K``; the layer's methods ``expert(e, rows)``,
``grouped(rows, offs, ids)``, ``all_experts(x_ERH)``, ``row_experts(x_SH, ids_S)`` (:mod:`tests.fuzz.emit`).
Output: ``out_TH`` in the activation dtype. The ``sorted`` and ``masked`` dispatches are written op for op as
``tests/models/composed.py``'s layer was, so that its forms are points of this grammar.
"""

from __future__ import annotations

from tests.fuzz.grammar import COUNTS, PERMUTES, Spec


def dispatch_lines(spec: Spec) -> list[str]:
    """The lines of the forward from the routing to ``out_TH``."""
    return {"sorted": _sorted, "masked": _sorted, "loop": _loop, "hit_loop": _loop, "skip_loop": _loop, "dense": _dense,
            "batched": _batched, "capacity": _capacity, "expert_choice": _expert_choice,
            "drop_and_pad": _drop_and_pad}[spec.dispatch](spec)


def _scale_rows(spec: Spec, name: str) -> list[str]:
    return [f"{name} = GradScale.apply({name}, 0.5)"] if spec.rows_fn == "grad_scale" else []


# ---- sort-based dispatch (and Megatron's masked_select) ---------------------------------------------------


def _sorted(spec: Spec) -> list[str]:
    flatten = {"reshape": "reshape(-1)", "view": "view(-1)", "flatten": "flatten()"}[spec.flatten]
    out = [f"ids_S = idx_TK.{flatten}"]
    if spec.dispatch == "masked":
        out += ["map_ET = torch.zeros(T, E, dtype=torch.bool, device=x_TH.device).scatter(1, idx_TK, True).T"
                ".contiguous()",
                "token_S = torch.arange(T, device=x_TH.device).unsqueeze(0).expand(E, -1).masked_select(map_ET)",
                "probs_TE = torch.zeros(T, E, dtype=w_TK.dtype, device=x_TH.device).scatter(1, idx_TK, w_TK)",
                "w_S = probs_TE.T.contiguous().masked_select(map_ET)",
                "rows_SH, ids_sorted_S, perm_S = x_TH.index_select(0, token_S), None, None"]
    else:
        out += PERMUTES[spec.permute].split("\n")
        out.append({"div": "token_S = perm_S // K",
                    "floor_divide": "token_S = torch.div(perm_S, K, rounding_mode='floor')",
                    "repeat_interleave": "token_S = torch.arange(T, device=x_TH.device).repeat_interleave(K)[perm_S]",
                    }[spec.token])
        out.append("w_S = w_TK.reshape(-1)[perm_S]")
        out.append({"index": "rows_SH = x_TH[token_S]", "index_select": "rows_SH = x_TH.index_select(0, token_S)",
                    "gather": "rows_SH = torch.gather(x_TH, 0, token_S.unsqueeze(-1).expand(-1, H))",
                    "custom_fn": "rows_SH = GatherRows.apply(x_TH, token_S)"}[spec.gather])
    if spec.weight == "before_experts":
        out.append("rows_SH = rows_SH * w_S.unsqueeze(-1).to(rows_SH.dtype)")
    out += COUNTS[spec.counts].split("\n")
    ids = ", ids_sorted_S" if spec.bias else ""
    if spec.padding == "device_static":
        out += _device_padded(spec)
    elif spec.host:
        out += _host_sized(spec, ids)
    else:
        offs = {"cumsum_int32": "torch.cumsum(counts_E, 0, dtype=torch.int32)",
                "cumsum_to": "counts_E.cumsum(0).to(torch.int32)"}[spec.offsets]
        out += [f"ys_SH = self.grouped(rows_SH, {offs}{ids})"]
    out += _scale_rows(spec, "ys_SH")
    return out + _combine(spec)


def _device_padded(spec: Spec) -> list[str]:
    """FP8-style padding on the device with a static row bound (``zeros[M, H][dest] = rows``, ``Y[dest]``)."""
    a = spec.align
    return [
        "S = T * K",
        f"M = (S + E * ({a} - 1)) // {a} * {a}",
        "counts_E = counts_E.long()",
        f"padded_E = (counts_E + {a} - 1) // {a} * {a}",
        "pad_end_E = torch.cumsum(padded_E, 0)",
        "start_E = torch.cumsum(counts_E, 0) - counts_E",
        "dest_S = (pad_end_E - padded_E)[ids_sorted_S] + torch.arange(S, device=rows_SH.device) "
        "- start_E[ids_sorted_S]",
        "rows_MH = rows_SH.new_zeros(M, rows_SH.shape[1])",
        "rows_MH[dest_S] = rows_SH",
        "ys_SH = self.grouped(rows_MH, pad_end_E.to(torch.int32))[dest_S]",
    ]


def _host_sized(spec: Spec, ids: str) -> list[str]:
    """Sizes read on the host: a loop over ``split`` chunks, or grouped GEMMs with host offsets, padded or not."""
    a = spec.align
    out = ["sizes = counts_E.long().tolist()"]
    if spec.exec == "split_loop":
        return out + ["ys_SH = torch.cat([self.expert(e, chunk) for e, chunk in "
                      "enumerate(torch.split(rows_SH, sizes))])"]
    if spec.padding == "none":
        offs = {"cumsum_int32": "torch.tensor(sizes, device=rows_SH.device).cumsum(0).to(torch.int32)",
                "cumsum_to": "torch.tensor(list(itertools.accumulate(sizes)), dtype=torch.int32, "
                             "device=rows_SH.device)"}[spec.offsets]
        return out + [f"offs_E = {offs}", f"ys_SH = self.grouped(rows_SH, offs_E{ids})"]
    out += [f"padded = [(n + {a} - 1) // {a} * {a} for n in sizes]", "chunks = torch.split(rows_SH, sizes)"]
    if spec.padding == "host_pad":
        out.append("rows_PH = torch.cat([F.pad(c, (0, 0, 0, p - n)) for c, n, p in zip(chunks, sizes, padded)])")
    else:
        out.append("rows_PH = torch.cat([torch.cat([c, c.new_zeros(p - n, c.shape[1])]) "
                   "for c, n, p in zip(chunks, sizes, padded)])")
    out += ["offs_E = torch.tensor(list(itertools.accumulate(padded)), dtype=torch.int32, device=rows_SH.device)",
            "y_PH = self.grouped(rows_PH, offs_E)", "pieces = torch.split(y_PH, padded)"]
    if spec.padding == "host_pad":
        out.append("ys_SH = torch.cat([y.narrow(0, 0, n) for y, n in zip(pieces, sizes)])")
    else:
        out.append("ys_SH = torch.cat([y[:n] for y, n in zip(pieces, sizes)])")
    return out


def _weigh_rows(spec: Spec, rows: str, w: str) -> list[str]:
    if spec.weight == "rows_fp32":
        return [f"{rows} = {rows}.float() * {w}.unsqueeze(-1)"]
    if spec.weight == "rows_act":
        return [f"{rows} = {rows} * {w}.unsqueeze(-1).to({rows}.dtype)"]
    return []


def _combine(spec: Spec) -> list[str]:
    out = _weigh_rows(spec, "ys_SH", "w_S")
    parts = spec.combine_parts
    if parts is None:
        if spec.combine == "custom_scatter":
            out.append("out_TH = ScatterRows.apply(ys_SH, token_S, T)")
        elif spec.combine == "index_add_functional":
            out.append("out_TH = torch.index_add(torch.zeros(T, H, dtype=ys_SH.dtype, device=ys_SH.device), 0, "
                       "token_S, ys_SH)")
        else:
            out.append("out_TH = torch.zeros(T, H, dtype=ys_SH.dtype, device=ys_SH.device)")
            out.append({"index_add": "out_TH.index_add_(0, token_S, ys_SH)",
                        "scatter_add": "out_TH.scatter_add_(0, token_S.unsqueeze(1).expand(-1, H), ys_SH)",
                        "index_put_acc": "out_TH.index_put_((token_S,), ys_SH, accumulate=True)"}[spec.combine])
        return out + ["out_TH = out_TH.to(x_TH.dtype)"]
    unpermute, reduce = parts
    out += {"scatter_unpermute": ["y_SH = torch.empty_like(ys_SH)", "y_SH[perm_S] = ys_SH"],
            "argsort_gather": ["y_SH = ys_SH[torch.argsort(perm_S)]"],
            "inverse_gather": ["inv_S = torch.empty_like(perm_S)",
                               "inv_S[perm_S] = torch.arange(perm_S.shape[0], device=perm_S.device)",
                               "y_SH = ys_SH[inv_S]"],
            "index_copy": ["y_SH = torch.zeros_like(ys_SH).index_copy_(0, perm_S, ys_SH)"]}[unpermute]
    out.append("y_TKH = y_SH.view(T, K, H)")
    if reduce == "sum":
        if spec.weight == "after_unpermute":
            out.append("y_TKH = y_TKH * w_TK.unsqueeze(-1).to(y_TKH.dtype)")
        out.append("out_TH = y_TKH.sum(1).to(x_TH.dtype)")
    elif reduce == "einsum":
        out.append("out_TH = torch.einsum('tkh,tk->th', y_TKH, w_TK.to(y_TKH.dtype)).to(x_TH.dtype)")
    else:
        out.append("out_TH = torch.bmm(w_TK.to(y_TKH.dtype).unsqueeze(1), y_TKH).squeeze(1).to(x_TH.dtype)")
    return out


# ---- loops over experts -------------------------------------------------------------------------------------


def _loop(spec: Spec) -> list[str]:
    """transformers 4.x / research code: per expert, its tokens by ``torch.where``; ``hit_loop`` runs only the
    experts hit (a ``.tolist()`` of a ``nonzero``: Dynamo cannot trace it, ``moe_compile.compile`` swaps it);
    ``skip_loop`` skips the experts whose host-read count is zero (the same for Dynamo and the swap)."""
    buf = ("torch.zeros(T, H, dtype=torch.float32, device=x_TH.device)" if spec.weight == "rows_fp32"
           else "torch.zeros_like(x_TH)")
    out = [f"out_TH = {buf}"]
    if spec.select == "one_hot":
        out.append("mask_EKT = F.one_hot(idx_TK, E).permute(2, 1, 0)")
    skip = []
    if spec.dispatch == "hit_loop":
        out.append("for e in torch.nonzero(mask_EKT.sum(dim=(1, 2)) > 0).flatten().tolist():")
    elif spec.dispatch == "skip_loop":  # reference inference code: counts read to the host, empty experts skipped
        out += ["counts_E = torch.bincount(idx_TK.flatten(), minlength=E).tolist()", "for e in range(E):"]
        skip = ["if counts_E[e] == 0:", "    continue"]
    else:
        out.append("for e in range(E):")
    body = skip + {"eq": ["tok, kpos = torch.where(idx_TK == e)"],
            "one_hot": ["kpos, tok = torch.where(mask_EKT[e])"],
            "nonzero": ["tok, kpos = (idx_TK == e).nonzero(as_tuple=True)"],
            "mask_any": ["tok = torch.nonzero((idx_TK == e).any(-1)).squeeze(-1)"]}[spec.select]
    body.append("w_R = (w_TK * (idx_TK == e)).sum(-1)[tok, None]" if spec.select == "mask_any"
                else "w_R = w_TK[tok, kpos, None]")
    body.append("rows_RH = x_TH[tok]")
    body.append({"before_experts": "y_RH = self.expert(e, rows_RH * w_R.to(rows_RH.dtype))",
                 "rows_act": "y_RH = self.expert(e, rows_RH) * w_R.to(x_TH.dtype)",
                 "rows_fp32": "y_RH = self.expert(e, rows_RH).float() * w_R"}[spec.weight])
    body += _scale_rows(spec, "y_RH")
    body.append({"index_add": "out_TH.index_add_(0, tok, y_RH.to(out_TH.dtype))",
                 "index_put_acc": "out_TH.index_put_((tok,), y_RH.to(out_TH.dtype), accumulate=True)",
                 "setitem_add": "out_TH[tok] += y_RH.to(out_TH.dtype)"}[spec.combine])
    return out + ["    " + line for line in body] + ["out_TH = out_TH.to(x_TH.dtype)"]


# ---- no dispatch: every expert on every token, per-row weights, capacity ----------------------------------


def _dense(spec: Spec) -> list[str]:
    """Every expert on every token, combined with the dense ``[T, E]`` routing weights (an einsum over the
    one-hot scatter of the top-k)."""
    up = ".float()" if spec.weight == "rows_fp32" else ""
    out = ["gates_TE = torch.zeros(T, E, dtype=w_TK.dtype, device=x_TH.device).scatter(1, idx_TK, w_TK)",
           "y_ETH = self.all_experts(x_TH.unsqueeze(0).expand(E, T, H))"]
    out += _scale_rows(spec, "y_ETH")
    cast = up or ".to(y_ETH.dtype)"
    return out + [f"out_TH = torch.einsum('eth,te->th', y_ETH{up}, gates_TE{cast}).to(x_TH.dtype)"]


def _batched(spec: Spec) -> list[str]:
    """transformers' ``batched_mm``: each routed row through its expert's gathered weights, then a sum over K."""
    out = ["ids_S = idx_TK.reshape(-1)", "x_SH = x_TH.repeat_interleave(K, dim=0)",
           "ys_SH = self.row_experts(x_SH, ids_S)", "w_S = w_TK.reshape(-1)"]
    out += _scale_rows(spec, "ys_SH")
    out += _weigh_rows(spec, "ys_SH", "w_S")
    out.append("y_TKH = ys_SH.view(T, K, H)")
    if spec.weight == "after_unpermute":
        out.append("y_TKH = y_TKH * w_TK.unsqueeze(-1).to(y_TKH.dtype)")
    return out + ["out_TH = y_TKH.sum(1).to(x_TH.dtype)"]


def _capacity(spec: Spec) -> list[str]:
    """GShard / Switch: a fixed capacity per expert (1.25 T K / E), slots in priority order, overflow dropped;
    dispatch and combine by einsums over a one-hot ``[T, E, C]`` tensor."""
    up = ".float()" if spec.weight == "rows_fp32" else ""
    out = ["C = (5 * T * K + 4 * E - 1) // (4 * E)",
           "mask_KTE = F.one_hot(idx_TK.T, E)",
           "pos_KTE = (torch.cumsum(mask_KTE.reshape(K * T, E), 0).reshape(K, T, E) - 1) * mask_KTE",
           "keep_KTE = mask_KTE * (pos_KTE < C)",
           "disp_KTEC = F.one_hot(pos_KTE.clamp(max=C - 1), C) * keep_KTE.unsqueeze(-1)",
           "disp_TEC = disp_KTEC.sum(0).to(x_TH.dtype)",
           "comb_TEC = (disp_KTEC * w_TK.T.reshape(K, T, 1, 1)).sum(0)",
           "x_ECH = torch.einsum('tec,th->ech', disp_TEC, x_TH)",
           "y_ECH = self.all_experts(x_ECH)"]
    out += _scale_rows(spec, "y_ECH")
    cast = up or ".to(y_ECH.dtype)"
    return out + [f"out_TH = torch.einsum('tec,ech->th', comb_TEC{cast}, y_ECH{up}).to(x_TH.dtype)"]


def _expert_choice(spec: Spec) -> list[str]:
    """Expert choice (Zhou et al. 2022): each expert takes its top-``C`` tokens by score (``C = 2T / E``, at least
    one), ``x[tok]`` gathers them to ``[E, C, H]``, the experts run batched, and the weighted rows are added back
    into their tokens' rows (a token is taken by 0..E experts)."""
    up = ".float()" if spec.weight == "rows_fp32" else ""
    # a router that took its top-k over the logits defines no scores (unless for its aux loss)
    out = ["scores_TE = logits_TE.softmax(-1)"] if spec.topk_on == "logits" and not spec.aux_loss else []
    out += ["C = max(1, 2 * T // E)",
            "g_EC, tok_EC = torch.topk(scores_TE.t(), C, dim=-1)",
            "y_ECH = self.all_experts(x_TH[tok_EC])"]
    out += _scale_rows(spec, "y_ECH")
    cast = "" if up else ".to(y_ECH.dtype)"
    out.append(f"y_NH = y_ECH.reshape(-1, H){up} * g_EC.reshape(-1, 1){cast}")
    return out + _add_into_tokens(spec, "tok_EC.reshape(-1)", "y_NH")


def _drop_and_pad(spec: Spec) -> list[str]:
    """Megatron-LM's drop-and-pad: each expert keeps its first ``C`` routed tokens (capacity factor 1.25, at most
    ``T``), the routing map turned ``[E, T]`` and ``argsort(descending=True, stable=True)[:, :C]`` gives each expert's
    tokens in token order padded with unrouted ones (weight 0), gathers by ``index_select`` (the gates through flat
    ``e*T + t`` indices), the experts batched over ``[E, C, H]``, and the weighted rows added back into a zero
    buffer."""
    up = ".float()" if spec.weight == "rows_fp32" else ""
    out = ["C = min(T, (5 * T * K + 4 * E - 1) // (4 * E))",
           "gates_TE = torch.zeros(T, E, dtype=w_TK.dtype, device=x_TH.device).scatter(1, idx_TK, w_TK)",
           "routed_TE = torch.zeros(T, E, dtype=torch.bool, device=x_TH.device).scatter(1, idx_TK, True)",
           "map_TE = routed_TE & (torch.cumsum(routed_TE.int(), 0) <= C)",
           "slots_N = map_TE.to(torch.int8).T.contiguous().argsort(dim=-1, descending=True, stable=True)[:, :C]"
           ".contiguous().view(-1)",
           "flat_N = (torch.arange(E, device=x_TH.device).unsqueeze(-1) * T + slots_N.view(E, C)).view(-1)",
           "probs_N = (gates_TE * map_TE).T.contiguous().view(-1).index_select(0, flat_N)",
           "y_ECH = self.all_experts(x_TH.index_select(0, slots_N).view(E, C, H))"]
    out += _scale_rows(spec, "y_ECH")
    cast = "" if up else ".to(y_ECH.dtype)"
    out.append(f"y_NH = y_ECH.reshape(E * C, H){up} * probs_N.unsqueeze(-1){cast}")
    return out + _add_into_tokens(spec, "slots_N", "y_NH")


def _add_into_tokens(spec: Spec, tok: str, rows: str) -> list[str]:
    """``out_TH``: the rows added into a zero ``[T, H]`` buffer at their tokens (``index_add_`` or ``scatter_add_``),
    cast back to the input's dtype."""
    add = {"index_add": f"out_TH.index_add_(0, {tok}, {rows})",
           "scatter_add": f"out_TH.scatter_add_(0, {tok}.unsqueeze(1).expand(-1, H), {rows})"}[spec.combine]
    return [f"out_TH = torch.zeros(T, H, dtype={rows}.dtype, device=x_TH.device)", add,
            "out_TH = out_TH.to(x_TH.dtype)"]
