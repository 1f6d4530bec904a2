"""The decoder's parts: a proposer (``proposer``) writes a step, a verifier (``verify``) reads it into typed
``Scores`` (``scores``), a pure acceptance policy (``policies``) decides, and the step loop (``loop``) commits or rolls
back; ``methods`` maps method names to runners, ``options`` holds the loop's options, ``hf`` runs transformers' own
loop as a baseline, ``speculative`` is token-level speculative sampling, ``prompts`` checks prompts, ``setup`` checks
probes and resolves their specs, ``results`` holds what a decode returns (see ``probes.decoder``)."""
