from app import create_app, jobqueue

app = create_app()
jobqueue.worker(app, queues=["signup"], concurrency=4).run()  # until SIGINT/SIGTERM
