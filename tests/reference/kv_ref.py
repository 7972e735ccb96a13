"""Reference for compact_kv_ (docs/design.md, op 9): returns new caches."""


def compact_kv_ref(k_cache, v_cache, accept_path, accept_len, prefix_lens):
    k, v = k_cache.cpu().clone(), v_cache.cpu().clone()
    src_k, src_v = k.clone(), v.clone()  # read everything before writing
    for b in range(k.shape[1]):
        L = int(prefix_lens[b])
        for i in range(int(accept_len[b]) + 1):
            s = L + int(accept_path[b, i])
            k[:, b, L + i] = src_k[:, b, s]
            v[:, b, L + i] = src_v[:, b, s]
    return k, v
