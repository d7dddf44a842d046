"""Treadle orchestrator: the asynchronous RL loop (dispatch under the policy-lag gate,
grouping, advantages, packing with treadle_native, BatchReady publication).

Today: the service shell (config, control plane, lifecycle). The loop lands with the
end-to-end async RL issue. This package never imports torch or vLLM.
"""
