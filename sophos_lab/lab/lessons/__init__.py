"""What each lesson needs that is not the lesson itself: its set-ups, views and exercise tests.

One module per lesson (`lesson_03a`, ...), so that a learner who wants to see how an experiment
is built reads it with `??` (for instance `lesson.relay??`) and the notebook keeps to the idea.
"""
