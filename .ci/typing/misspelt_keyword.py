# .ci/typecheck expects mypy to REJECT this file: if it passed, sfq's lazy names would be
# Any to type checkers, and a misspelt keyword would go unnoticed until run time.
import sfq

d = sfq.Dispatcher(["http://localhost:8000"], overtak=1)
s = sfq.Scheduler()
s.enqueue("a", 1.0, itme="x")
