"""Why a ResourceClaim is pending, in the scheduler's terms.

``claims.explain_claim`` walks each request through the allocator's filters
(``requests``) over the devices of complete pools and their holders (``inventory``),
then checks the claim as a whole and which nodes the waiting Pods may go to
(``nodefit``); ``fromapi`` reads the inputs for ``drasil explain``. Used by the
controller (Events on pending claims) and the CLI; never by the node daemon, which
must stay small and never evaluates CEL.
"""
