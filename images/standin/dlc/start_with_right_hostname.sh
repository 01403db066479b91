#!/usr/bin/env bash
# The stand-in's ENTRYPOINT script, written here to behave as the DLC's own /usr/local/bin/start_with_right_hostname.sh
# (aws/deep-learning-containers scripts/docker/pytorch/start_with_right_hostname.sh; the SageMaker image runs it as
# ENTRYPOINT ["bash", "-m", "start_with_right_hostname.sh"], CMD ["/bin/bash"], WORKDIR /workspace). Its hostile
# parts are kept on purpose, so that what we build FROM the stand-in meets them:
#  - it imports torch once to ask for a GPU, and only then runs start_cuda_compat.sh, in a child shell (so the
#    LD_LIBRARY_PATH that script exports is lost);
#  - for `train` it reads current_host with jq (a JSON string: the quotes come along), pastes it over
#    PLACEHOLDER_HOSTNAME in ./changehostname.c and compiles ./libchangehostname.so, both relative to the working
#    directory, then preloads /libchangehostname.so: the fix works only when the working directory is / and jq
#    is installed (the DLC's Dockerfile installs no jq; neither does the stand-in);
#  - `train` is started with no arguments: whatever followed it on the command line is dropped;
#  - anything else goes through eval.
# The telemetry call of the real script (a request to AWS) is left out: no network here.

has_gpu=$(python -c "import torch; print(torch.cuda.is_available())")
if [ "$has_gpu" = "True" ]; then
    bash /usr/local/bin/start_cuda_compat.sh
fi

if [[ "$1" = "train" ]]; then
    host=$(jq .current_host /opt/ml/input/config/resourceconfig.json)
    sed -ie "s/PLACEHOLDER_HOSTNAME/$host/g" changehostname.c
    gcc -o changehostname.o -c -fPIC -Wall changehostname.c
    gcc -o libchangehostname.so -shared -export-dynamic changehostname.o -ldl
    LD_PRELOAD=/libchangehostname.so train
else
    eval "$@"
fi
