"""``memfit report``'s offline HTML pages: one per run directory, memory snapshot, plan and bench directory.

``html`` holds the building blocks (escaping, tables, the chart placeholders and the inline assets); ``run``,
``snapshot``, ``plan`` and ``bench`` each turn one kind of result into a ``Page``. Measuring and deciding stay in
their own packages: these modules read their results and present them.
"""
