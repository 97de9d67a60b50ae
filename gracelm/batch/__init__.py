"""The OpenAI Batch API's durable side, with no HTTP and no engine: the journal that keeps uploaded files,
batches, their lines and each line's result across crashes (`journal.py`, SQLite), the checks of an input
file (`validation.py`), the shapes of OpenAI's objects and output lines (`objects.py`), and the runner that
takes a batch from validation to its end and runs its lines through a line executor it is given
(`runner.py`). The routes (`server/batch_routes.py`), the line executor (`server/batch_lines.py`)
and `gracelm run-batch` (`cli/run_batch.py`) sit above it. See docs/batch.md, "The journal".
"""
