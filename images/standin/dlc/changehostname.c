/* The stand-in's /changehostname.c, written here from the DLC's scripts/docker/pytorch/changehostname.c: a
 * gethostname() that returns the SageMaker host name (algo-1, algo-2, ...), so that NCCL/MPI see several hosts
 * (on SageMaker the container's own host name is the same on every host). PLACEHOLDER_HOSTNAME is a token that
 * start_with_right_hostname.sh replaces with the JSON string of current_host (quotes included) before compiling;
 * a compiler can also define it: -DPLACEHOLDER_HOSTNAME='"algo-1"'. */
#include <stdio.h>
#include <string.h>

int gethostname(char *name, size_t len)
{
    const char *host = PLACEHOLDER_HOSTNAME;
    strncpy(name, host, len);
    return 0;
}
