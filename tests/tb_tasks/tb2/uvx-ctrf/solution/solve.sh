#!/bin/bash
printf '#!/bin/bash\necho "hello, $1"\n' > /app/greet.sh
chmod +x /app/greet.sh
pip freeze > /app/freeze.txt
