"""What each lesson needs that is not the lesson itself: its set-ups, views and exercise tests.

One module per lesson (`lesson_02`, ...; the sub-lessons 03a and 03b share `lesson_03`), so that a learner who wants to see how an experiment
is built reads it with `??` (for instance `lesson.relay??`) and the notebook keeps to the idea.
"""
