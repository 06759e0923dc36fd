import sys

from ddp_course.diagrams import main

sys.exit(main(sys.argv[1:]))
