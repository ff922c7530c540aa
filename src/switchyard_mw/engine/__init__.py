"""Per-request decisions both fronts share.

Routes and models, variants, accounts and their outcomes, deadlines, the judge, and what a
response says about them: the ASGI middlewares and the ext_proc server both call these.
"""
