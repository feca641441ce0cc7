#!/bin/bash
python -c "n=[int(x) for x in open('/data/numbers.txt')]; open('/app/sum.txt','w').write(str(sum(n))); open('/app/max.txt','w').write(str(max(n)))"
