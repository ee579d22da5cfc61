"""What a prefill and a decode worker process share: the process runtime (`runtime`: flags, main,
drain), worker groups (`group`) and their protocols (`tp`: tensor-parallel leader/follower, `ep`:
expert-parallel lock-step), the service base (`service`) and hand-off stages (`stages`). The workers'
own rooms (`prefill_worker/`, `decode_worker/`) keep only their servicers and hand-off stages."""
